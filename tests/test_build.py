"""The generated C++ renders deterministically, builds against the real torch and cuBLAS
headers, loads as a torch op, and fails clearly. Runs without a GPU."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import stream_matmul_columns

import codegen as cg
from codegen.examples import DISTRIBUTED_EXAMPLES, EXAMPLES
from codegen.jit import BuildError, build_library
from tools.regen import CSRC_GEN, stale_goldens

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ops(cache_dir):
    return {name: cg.compile(ex.make()) for name, ex in EXAMPLES.items()}


def test_goldens_are_up_to_date():
    diff = stale_goldens(CSRC_GEN)
    assert not diff, f"csrc_gen/ is stale; run `python tools/regen.py`:\n{diff}"


def test_render_is_deterministic_and_has_no_paths():
    a = cg.render(cg.lower(stream_matmul_columns()))
    b = cg.render(cg.lower(stream_matmul_columns()))
    assert a == b
    assert a.startswith("// @generated")
    assert str(REPO) not in a and "0x" not in a


def test_every_hir_line_appears_in_the_cpp():
    program = cg.lower(EXAMPLES["two_matmuls_not_inlinable"].make())
    source = cg.render(program)
    for node in program.nodes():
        assert f"// hir: {node}" in source


@pytest.mark.parametrize("name", sorted(EXAMPLES))
@pytest.mark.build
def test_example_builds_and_loads(ops, name):
    op = ops[name]
    assert op.name.startswith(f"codegen::{name}_")
    assert op.library.is_file()
    # The checked-in C++ (csrc_gen/, reviewed) is what the op says it is and what was built,
    # but for the op's name: a hash of the program and of the package's modules, which
    # test_goldens_are_up_to_date checks.
    golden = (CSRC_GEN / f"{name}.cpp").read_text()
    (golden_name,) = set(re.findall(rf"\b{name}_[0-9a-f]{{12}}\b", golden))
    built = (op.library.parent / f"{op.op_name}.cpp").read_text()
    for text in (op.source, built):
        assert text.replace(op.op_name, golden_name) == golden
    assert hasattr(torch.ops.codegen, op.name.split("::")[1])


@pytest.mark.parametrize("name", sorted(EXAMPLES))
@pytest.mark.build
def test_meta_tensors_give_output_shapes(ops, name):
    ex = EXAMPLES[name]
    dtype = ex.make().inputs[0].dtype
    # Inputs declared in host memory are CPU tensors (a meta tensor there is refused).
    args = [torch.empty(s, device=d, dtype=dtype) for s, d in zip(ex.shapes, ex.devices("meta"))]
    out = ops[name](*args)
    expect = cg.evaluate(cg.lower(ex.make()), [torch.zeros(s, dtype=dtype) for s in ex.shapes])[0]
    host_output = ops[name].host_ir.allocations()[ops[name].host_ir.outputs[0]].device == "cpu"
    assert out.device.type == ("cpu" if host_output else "meta")
    assert out.shape == expect.shape and out.dtype == dtype


@pytest.mark.build
def test_fake_tensor_mode(ops):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a, b = torch.empty(37, 24), torch.empty(24, 20)
        out = ops["matmul_rows"](a, b)
    assert out.shape == (37, 20)


@pytest.mark.build
def test_cpu_tensors_get_a_clear_error(ops):
    with pytest.raises(RuntimeError, match="matmul_rows: argument T0 must be a CUDA tensor, "
                                           "got a tensor on cpu"):
        ops["matmul_rows"](torch.ones(4, 3), torch.ones(3, 2))


@pytest.mark.build
def test_fusion_names_that_are_cpp_words_build(cache_dir):
    """The C++ function is <name>_program: a keyword, a macro or an overloaded C
    function as a Fusion's name builds."""
    for name in ("float", "stdin", "abs"):
        with cg.Fusion(name) as fusion:
            cg.output(cg.relu(cg.input(["m"], name="x")))
        op = cg.compile(fusion)
        assert f"torch::stable::Tensor {name}_program(torch::stable::Tensor x_arg)" in op.source
        assert f'const char* const op = "{name}";' in op.source


@pytest.mark.build
def test_a_program_of_host_inputs_needs_a_gpu_to_run(cache_dir):
    with cg.Fusion("host_only") as fusion:
        out = cg.matmul(cg.input(["m", "k"], device="cpu"), cg.input(["k", "n"], device="cpu"))
        cg.output(out, device="cpu")
    op = cg.compile(fusion)
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(cg.NoGPUError, match="host_only: the compiled op runs on a CUDA GPU, "
                                            "and this machine has none; cg.evaluate"):
        op(torch.ones(2, 3), torch.ones(3, 4))


def test_build_takes_a_host_program():
    with pytest.raises(TypeError, match=r"build expects a cg.HostProgram \(from cg.lower\), "
                                        r"got Fusion; for a cg.Fusion, cg.compile\(fusion\)"):
        cg.build(EXAMPLES["matmul_rows"].make())


@pytest.mark.build
def test_missing_argument_is_refused_by_the_schema(ops):
    with pytest.raises((RuntimeError, TypeError), match="T1"):
        ops["matmul_rows"](torch.ones(4, 3, device="meta"))


@pytest.mark.build
def test_two_programs_in_one_process_do_not_collide(ops):
    names = {op.name for op in ops.values()}
    assert len(names) == len(ops)
    small = cg.compile(EXAMPLES["matmul_rows"].make(), pool_size=2)
    assert small.name != ops["matmul_rows"].name


def _run(code: str, cache: Path, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "CODEGEN_CACHE_DIR": str(cache), **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full_env, cwd=REPO, timeout=600)


LOAD_STREAM_MATMUL = """
import torch, codegen as cg
from codegen.examples import stream_matmul_n
op = cg.compile(stream_matmul_n())
print(op(torch.empty(5, 7, device="meta"), torch.empty(7, 6, device="meta")).shape)
"""


@pytest.mark.build
def test_second_process_loads_from_cache_without_compiling(ops, cache_dir):
    first = _run(LOAD_STREAM_MATMUL, cache_dir)
    assert first.returncode == 0, first.stderr
    assert "codegen: built" not in first.stderr  # built by the fixture already
    assert "torch.Size([5, 6])" in first.stdout


@pytest.mark.build
def test_rebuild_env_forces_a_build(ops, cache_dir):
    run = _run(LOAD_STREAM_MATMUL, cache_dir, CODEGEN_REBUILD="1")
    assert run.returncode == 0, run.stderr
    assert "codegen: built stream_matmul_n_" in run.stderr


@pytest.mark.build
def test_corrupt_library_is_detected_and_rebuilt(tmp_path):
    first = _run(LOAD_STREAM_MATMUL, tmp_path)
    assert first.returncode == 0 and "codegen: built" in first.stderr, first.stderr
    (library,) = tmp_path.glob("stream_matmul_n*/*.so")
    library.write_bytes(library.read_bytes()[:1000])  # truncated, as by a full disk
    second = _run(LOAD_STREAM_MATMUL, tmp_path)
    assert second.returncode == 0, second.stderr
    assert "codegen: built stream_matmul_n" in second.stderr
    assert "torch.Size([5, 6])" in second.stdout


@pytest.mark.build
def test_compile_error_names_the_first_error_and_the_log(cache_dir):
    with pytest.raises(BuildError, match=r"building broken_op failed: .*error.*\nfull log: "
                                         r".*build.log") as info:
        build_library("broken_op", "#include <torch/library.h>\nint f() { return undefined_x; }\n")
    log = Path(str(info.value).split("full log: ")[1])
    assert "undefined_x" in log.read_text()
    assert len(str(info.value).splitlines()) == 2  # not the whole log


@pytest.mark.build
def test_unwritable_cache_dir_is_a_clear_error(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("CODEGEN_CACHE_DIR", str(blocker / "cache"))
    with pytest.raises(BuildError, match="cannot create the build cache .*CODEGEN_CACHE_DIR"):
        build_library("never_built", "// nothing")


@pytest.mark.build
def test_fake_impl_checks_inputs_like_the_op(ops):
    rows = ops["matmul_rows"]
    with pytest.raises(ValueError, match="argument T1 axis 0 must have size k = 24, got 5"):
        rows(torch.empty(37, 24, device="meta"), torch.empty(5, 20, device="meta"))
    with pytest.raises(ValueError, match="argument T0 must be float32, got torch.float16"):
        rows(torch.empty(37, 24, device="meta", dtype=torch.half), torch.empty(24, 20,
                                                                                device="meta"))


@pytest.mark.build
def test_too_many_arguments(ops):
    m = torch.empty(2, 2, device="meta")
    with pytest.raises((RuntimeError, TypeError), match="(?i)argument|expected"):
        ops["matmul_rows"](m, m, m)


@pytest.mark.parametrize("call", ["compiled_op", "torch_ops"])
@pytest.mark.build
def test_inputs_that_require_grad_get_a_backward(ops, call):
    """Whoever calls the op, autograd records it, and backward runs the derived backward
    program (on meta tensors, its fake kernel: the shapes)."""
    op = ops["matmul_rows"]
    fn = op if call == "compiled_op" else op.op
    a = torch.empty(3, 24, device="meta", requires_grad=True)
    b = torch.empty(24, 5, device="meta", requires_grad=True)
    out = fn(a, b)
    assert out.shape == (3, 5) and out.requires_grad
    out.sum().backward()
    assert a.grad.shape == (3, 24) and b.grad.shape == (24, 5)
    with torch.no_grad():
        assert not fn(a, b).requires_grad


def _autograd_kernel(name):
    dump = torch._C._dispatch_dump(name)
    (line,) = [line for line in dump.splitlines() if line.startswith("Autograd[")
               or line.startswith("Autograd:")]
    return line


@pytest.mark.build
def test_a_backward_program_gets_torchs_cpp_no_backward_kernel(ops):
    """A differentiable op's autograd kernel is the Python one of codegen.runtime.autograd (the
    compiled op calls below it when nothing records, so no trip through Python then); a
    backward program has no backward: torch's C++ kernel, which costs nothing."""
    from codegen.runtime import autograd

    assert "codegen_no_backward.cpp" not in _autograd_kernel(ops["matmul_rows"].name)
    program = ops["matmul_rows"].host_ir
    g = autograd.derive(program.source, (True, True))
    backward = cg.build(cg.lower(g.backward).replace(source=None))
    assert "codegen_no_backward.cpp" in _autograd_kernel(backward.name)


@pytest.mark.build
def test_two_outputs_and_an_op_outside_any_loop_build(cache_dir):
    with cg.Fusion("two_outputs") as fusion:
        a, w1, w2 = cg.input(["m", "k"]), cg.input(["k", "n"]), cg.input(["n", "p"])
        t1 = cg.matmul(a, w1)  # no stream axis: runs on the caller's stream
        t2 = cg.matmul(t1, w2)
        cg.output(t1)
        cg.output(t2)
    t2.outer_split(1, 2)  # columns of t2: w2 is sliced, t1 is read whole
    t2.axis(1).parallelize(cg.ParallelType.Stream)
    op = cg.compile(fusion)
    assert "-> (Tensor, Tensor)" in op.source
    first_loop = op.source.index("// hir: for")
    assert op.source.index("// hir: Matmul(T0, T1, out=T3)") < first_loop
    o1, o2 = op(torch.empty(5, 3, device="meta"), torch.empty(3, 4, device="meta"),
                torch.empty(4, 2, device="meta"))
    assert o1.shape == (5, 4) and o2.shape == (5, 2)


@pytest.mark.parametrize("name", sorted(DISTRIBUTED_EXAMPLES))
@pytest.mark.build
def test_distributed_example_builds_and_gives_shapes(cache_dir, name):
    ex = DISTRIBUTED_EXAMPLES[name]
    op = cg.compile(ex.make())
    assert "str group_name" in str(op.op.default._schema)
    args = [torch.empty(s, device="meta", dtype=torch.bfloat16) for s in ex.shapes]
    out = op.op(*args)  # torch.ops directly, the default group's name
    rows = 2 * 16 if name.startswith("allgather") else 16 // 2
    assert out.shape == (rows, 24) and out.dtype == torch.bfloat16


def test_allocations_are_kept_until_the_workers_joined():
    # On an exception mid-loop the locals are destroyed before the join is queued; the
    # call's Streams keeps what the program allocated until after it.
    source = cg.render(cg.lower(EXAMPLES["two_matmuls_not_inlinable"].make()))
    allocations = [line.strip() for line in source.splitlines() if "rt::empty(" in line]
    assert allocations and all("streams.keep(rt::empty(" in a for a in allocations)


def test_a_call_claims_a_caller_workspace_only_for_gemms_on_the_callers_stream():
    """rt::Streams(device, caller_gemms): worker-only programs leave the caller's
    workspace slots (four per thread) to programs that run GEMMs there."""
    from codegen import examples as ex

    def streams_line(program):
        (line,) = [s.strip() for s in cg.render(program).splitlines()
                   if s.strip().startswith("rt::Streams streams(")]
        return line.split(";")[0]

    assert streams_line(cg.lower(ex.matmul_rows(torch.float32, 4))) == \
        "rt::Streams streams(device)"
    assert streams_line(cg.lower(ex.matmul_rows(torch.float32, 1))) == \
        "rt::Streams streams(device, /*caller_gemms=*/true)"
    assert streams_line(cg.lower(ex.matmul_rows(torch.float32, 4), pool_size=1)) == \
        "rt::Streams streams(device, /*caller_gemms=*/true)"
