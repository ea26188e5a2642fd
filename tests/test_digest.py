"""The op name hashes every field of every node (codegen.backend.digest), not the program's dump:
two programs whose C++ may differ never share a name, and so never a cached library."""

import dataclasses
import enum
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import codegen as cg
from codegen import distributed
from codegen import examples as ex
from codegen import hostir as hir
from codegen.backend import digest
from codegen.backend.renderer import op_name, program_digest
from codegen.errors import InternalError

REPO = Path(__file__).resolve().parent.parent


def tied() -> cg.Fusion:
    """a @ b with free extents: the program has a constraint (a's columns, b's rows)."""
    with cg.Fusion("tied") as fusion:
        a = cg.input([None, None])
        b = cg.input([None, None])
        out = cg.matmul(a, b)
        cg.output(out)
    out.outer_split(0, 2)
    out.axis(0).parallelize(cg.ParallelType.Stream)
    return fusion


# Programs that hold, together, every node class of hostir and distributed, and every
# field of each (and of the program and its values) with a value other than None or an
# empty list somewhere.
PROGRAMS = {
    "stream_weights, copy stream, pool 2":
        lambda: cg.lower(ex.stream_weights(slices=8), pool_size=2, copy_stream=True),
    "offload_activations": lambda: cg.lower(ex.offload_activations()),
    "stream_weights, staging ring": lambda: cg.lower(ex.stream_weights(slices=8),
                                                     staging="ring"),
    "linear_bias, 8 SMs": lambda: cg.lower(ex.linear_bias(), gemm_sm_count=8),
    "two_matmuls_not_inlinable, cublas":
        lambda: cg.lower(ex.two_matmuls_not_inlinable(), gemm_library="cublas"),
    "tied": lambda: cg.lower(tied()),
    "allgather_matmul_2x4": lambda: cg.lower(ex.allgather_matmul_2x4()),
    "matmul_reduce_scatter_2x4": lambda: cg.lower(ex.matmul_reduce_scatter_2x4()),
    "llama_mlp": lambda: cg.lower(ex.llama_mlp()),
    "gpt_mlp": lambda: cg.lower(ex.gpt_mlp()),
    "stream_weights, split contraction left to the call":
        lambda: cg.lower(ex.stream_weights(slices=4), split_contraction="auto"),
}


def node_classes() -> set[type]:
    return {c for m in (hir, distributed) for c in vars(m).values()
            if isinstance(c, type) and issubclass(c, hir.Node)
            and c not in (hir.Node, hir.Compute)}  # Compute: only its subclasses are made


# The other classes a program holds: itself and the values in its fields and nodes'.
VALUE_CLASSES = (hir.HostProgram, hir.TensorInfo, hir.Constraint, hir.Stream, hir.CopyStream,
                 hir.RingStream, hir.Apply, hir.ContractionChoice, hir.StreamedMatmul,
                 hir.Options)


# ---------------------------------------------------------------------------- the defects


def test_copy_stream_pool_is_part_of_the_op_name():
    """With 2 slices, pool 2 and pool 4 both run slice i on Stream(i); only the copy
    stream's position differs, which the dump does not print."""
    two, four = (cg.lower(ex.stream_weights(slices=2), pool_size=p, copy_stream=True)
                 for p in (2, 4))
    assert "streams.copy_stream(2)" in cg.render(two)
    assert "streams.copy_stream(4)" in cg.render(four)
    assert op_name(two) != op_name(four)


def test_check_divisible_reason_is_part_of_the_op_name():
    program = cg.lower(ex.allgather_matmul_2x4())
    check = next(n for n in program.body if isinstance(n, distributed.CheckDivisible))
    other = program.replace(body=[dataclasses.replace(n, reason="another reason")
                                  if n is check else n for n in program.body])
    assert f"({check.reason})" in cg.render(program)
    assert "(another reason)" in cg.render(other)
    assert op_name(program) != op_name(other)


def test_op_name_is_the_program_name_and_12_hex_digits():
    program = PROGRAMS["tied"]()
    assert re.fullmatch(r"tied_[0-9a-f]{12}", op_name(program))
    assert op_name(program) == f"tied_{program_digest(program)[:12]}"


# ---------------------------------------------------------------------------- every field

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def variants(value):
    """Yields ``(fields, changed)``: ``changed`` is ``value`` with one part replaced by
    another value of the same type; ``fields`` are the dataclass fields on the way to
    that part, ``(class name, field name)`` each, outermost first. Nodes inside lists are
    left alone (the walk changes each node itself). None has no other value of its type:
    nothing is yielded for it."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in _digested(value):  # a nested program's source fusion has no variants
            for inner, v in variants(getattr(value, f.name)):
                yield ((type(value).__qualname__, f.name), *inner), \
                    dataclasses.replace(value, **{f.name: v})
    elif isinstance(value, (list, tuple)):
        items, kind = list(value), type(value)
        if items:
            yield (), kind(items[:-1])
            yield (), kind([*items, items[0]])
        for k, item in enumerate(items):
            if not isinstance(item, hir.Node):
                for inner, v in variants(item):
                    yield inner, kind([*items[:k], v, *items[k + 1:]])
    elif isinstance(value, bool):
        yield (), not value
    elif isinstance(value, enum.Enum):
        yield from (((), m) for m in type(value) if m is not value)
    elif isinstance(value, int):
        yield (), value + 1
    elif isinstance(value, str):
        yield (), value + "x"
    elif isinstance(value, torch.dtype):
        yield (), next(d for d in DTYPES if d != value)
    elif value is not None:
        raise AssertionError(f"no variant of a {type(value).__name__}")


def _digested(value):
    """The fields the digest covers: all but those marked ``digest: False`` (a program's
    source fusion, which its nodes already say all of)."""
    return [f for f in dataclasses.fields(value) if f.metadata.get("digest", True)]


def test_only_the_source_fusion_is_left_out():
    left_out = {(type(v).__name__, f.name) for v in [PROGRAMS["llama_mlp"](),
                                                     *PROGRAMS["llama_mlp"]().nodes()]
                for f in dataclasses.fields(v) if f not in _digested(v)}
    assert left_out == {("HostProgram", "source")}


def fields_in(value, found: set[tuple[str, str]]) -> None:
    """Adds the (class name, field name) of every dataclass field in ``value`` whose
    value is not None nor empty (those have no variants)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in _digested(value):
            if getattr(value, f.name) not in (None, [], ()):
                found.add((type(value).__qualname__, f.name))
            fields_in(getattr(value, f.name), found)
    elif isinstance(value, (list, tuple)):
        for item in value:
            fields_in(item, found)


@pytest.mark.parametrize("label", sorted(PROGRAMS))
def test_changing_any_field_of_any_node_changes_the_digest(label):
    """Each field of the program and of each node (its alternative's too), set in turn to
    each of its variants (and back): the digest differs from the program's every time, and
    every field with a value is changed at least once."""
    program = PROGRAMS[label]()
    before = program_digest(program)
    changed: set[tuple[str, str]] = set()
    unchanged: list[str] = []
    nested = [*program.nodes(), *(program.alternative.nodes() if program.alternative else [])]
    for k, node in enumerate([program, *nested]):
        for f in _digested(node):
            original = getattr(node, f.name)
            for inner, value in variants(original):
                object.__setattr__(node, f.name, value)
                try:
                    if program_digest(program) == before:
                        unchanged.append(f"object {k} ({type(node).__name__}).{f.name} = "
                                         f"{value!r}")
                finally:
                    object.__setattr__(node, f.name, original)
                changed.update([(type(node).__qualname__, f.name), *inner])
    assert program_digest(program) == before
    assert not unchanged, "changes the digest missed:\n" + "\n".join(unchanged)
    present: set[tuple[str, str]] = set()
    fields_in(program, present)
    assert present - changed == set()


def test_the_programs_hold_every_node_class():
    seen = {type(n) for make in PROGRAMS.values() for n in make().nodes()}
    assert {c.__name__ for c in node_classes() - seen} == set()


def test_the_programs_hold_every_field_of_every_node_and_value_class():
    present: set[tuple[str, str]] = set()
    for make in PROGRAMS.values():
        fields_in(make(), present)
    expected = {(c.__qualname__, f.name) for c in [*node_classes(), *VALUE_CLASSES]
                for f in dataclasses.fields(c) if f.metadata.get("digest", True)}
    assert expected - present == set()


# ---------------------------------------------------------------------------- the format


def test_canonical_text_of_values():
    value = {"b": [1, 2.0, None, True], "a": ("x\"y",), "c": torch.bfloat16,
             "d": cg.ParallelType.Stream, "e": hir.Stream("i", 4), "f": ()}
    assert digest.canonical(value) == (
        '{"b": [1, 2.0, None, True], "a": ("x\\"y",), "c": torch.bfloat16, '
        '"d": codegen.frontend.ir.ParallelType.Stream, '
        '"e": codegen.hostir.nodes.Stream(index="i", pool=4, base=0), "f": ()}')


def test_canonical_text_of_extents():
    from codegen.frontend.ir import CeilDiv, Const, Sym

    assert digest.canonical(CeilDiv(Sym("n"), Const(4))) == \
        ('codegen.frontend.ir.CeilDiv(lhs=codegen.frontend.ir.Sym(name="n"), '
         'rhs=codegen.frontend.ir.Const(value=4))')


def test_canonical_text_tells_apart_what_str_does_not():
    assert digest.canonical(hir.CopyStream(2)) != digest.canonical(hir.CopyStream(4))
    assert str(hir.Stream("i", 4)) != str(hir.Stream("i", None))  # and what it does
    assert digest.canonical(1) != digest.canonical("1") != digest.canonical(1.0)
    assert digest.canonical([1]) != digest.canonical((1,))
    assert digest.canonical({"a": 1, "b": 2}) != digest.canonical({"b": 2, "a": 1})


@pytest.mark.parametrize("label", sorted(PROGRAMS))
def test_canonical_text_has_no_addresses(label):
    text = digest.canonical(PROGRAMS[label]())
    assert "0x" not in text and " object at " not in text


class Size(int):
    pass


@pytest.mark.parametrize(("value", "message"), [
    (object(), "builtins.object (at object)"),
    ({1, 2}, "builtins.set (at set)"),
    (Size(3), "test_digest.Size (at Size)"),
    (hir.Stream, "builtins.type (at type)"),  # a dataclass itself, not an instance
    ([1, (2, {"k": frozenset()})], "builtins.frozenset (at list[1][1]['k'])"),
])
def test_unknown_types_raise(value, message):
    with pytest.raises(InternalError, match=re.escape(f"no canonical form for a value of "
                                                      f"type {message}")):
        digest.canonical(value)


def test_a_node_field_of_an_unknown_type_raises_naming_where():
    program = cg.lower(ex.allgather_matmul_2x4())
    comm = next(n for n in program.nodes() if isinstance(n, distributed.Communication))
    comm.team = frozenset(comm.team)
    with pytest.raises(InternalError, match=r"builtins\.frozenset \(at HostProgram\.body"
                                            r"\[\d+\]\.body\[\d+\]\.team\)"):
        op_name(program)


def test_a_value_that_contains_itself_raises():
    value: list = [1]
    value.append(value)
    with pytest.raises(InternalError, match=re.escape("list[1] contains itself")):
        digest.canonical(value)
    shared = [1]
    assert digest.canonical([shared, shared]) == "[[1], [1]]"  # shared is not a cycle


def test_digest_is_the_same_in_other_processes():
    """No hash randomization: other hash seeds give the same op names."""
    code = ("import codegen as cg; from codegen import examples as ex; "
            "from codegen.backend.renderer import op_name; "
            "print(op_name(cg.lower(ex.allgather_matmul_2x4())), "
            "op_name(cg.lower(ex.stream_weights(slices=2), pool_size=2, copy_stream=True)))")
    here = " ".join([op_name(cg.lower(ex.allgather_matmul_2x4())),
                     op_name(cg.lower(ex.stream_weights(slices=2), pool_size=2,
                                      copy_stream=True))])
    for seed in ("0", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True)
        assert out.stdout.strip() == here
