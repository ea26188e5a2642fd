"""The documentation against the code: every relative link resolves, every concrete
``python -m codegen`` command parses, every ``python -m benchmarks.NAME`` names a module
that takes the flags shown, and the printed choice of ``split_contraction="auto"``, the
staging ring's host IR and the runtime's C++ excerpt are what the code prints."""

import re
from pathlib import Path

import pytest
import torch

import codegen as cg
from codegen.tools.cli import command_line

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "benchmarks" / "RESULTS.md", ROOT / "benchmarks" / "probes" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
COMMAND = re.compile(r"`(python -m (codegen|benchmarks\.[\w.]+)[^`]*)`")


def commands(prefix):
    """The commands in code spans of the docs that start with ``prefix`` and hold no
    placeholder (an upper-case word, brackets, alternatives or an ellipsis)."""
    found = []
    for doc in DOCS:
        for text, _ in COMMAND.findall(doc.read_text()):
            words = text.split()
            if text.startswith(prefix) and not any(
                    any(part.isupper() for part in re.split(r"[.=/,]", w))
                    or set(w) & set("[]|<>") or "..." in w for w in words):
                found.append((doc.name, words))
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_relative_links_resolve(doc):
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (doc.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{doc.name}: link to {target}"


def test_codegen_commands_parse():
    found = commands("python -m codegen ")
    assert len(found) >= 3
    for doc, words in found:
        try:
            command_line().parse_args(words[3:])
        except SystemExit:
            pytest.fail(f"{doc}: {' '.join(words)} does not parse")


def test_benchmark_commands_name_modules_and_their_flags():
    found = commands("python -m benchmarks.")
    assert len(found) >= 10
    for doc, words in found:
        module = ROOT / (words[2].replace(".", "/") + ".py")
        assert module.exists(), f"{doc}: {' '.join(words)}"
        source = module.read_text()
        for flag in (w.split("=")[0] for w in words[3:] if w.startswith("--")):
            assert f'"{flag}"' in source, f"{doc}: {' '.join(words)}: no {flag}"


def test_the_printed_choice_in_the_docs_is_the_lowerings():
    text = (ROOT / "docs" / "host-operands.md").read_text()
    block = text.split("```\nHostProgram sw(", 1)[1].split("```", 1)[0]
    with cg.Fusion("sw") as f:
        out = cg.matmul(cg.input([3072, 8192], torch.bfloat16, name="x"),
                        cg.input([8192, 8192], torch.bfloat16, name="w", device="cpu"))
        cg.output(out)
    out.outer_split(1, 4)
    out.axis(1).parallelize(cg.ParallelType.Stream)
    printed = str(cg.lower(f, split_contraction="auto")).splitlines()
    shown = ("HostProgram sw(" + block).rstrip("\n").splitlines()
    assert printed[:len(shown)] == shown


def _excerpt_mismatch(shown, printed):
    """The first line of the excerpt ``shown`` (comments dropped) that is not the next line
    of ``printed``: consecutive lines must be consecutive there, except after a line
    ``...``, which skips ahead (so does the first line). None where the excerpt matches."""
    printed = [line.rstrip() for line in printed]
    at, skip = 0, True
    for line in shown:
        line = re.split(r"\s+(#|// an NVTX)", line)[0].rstrip()
        if line.strip() == "...":
            skip = True
            continue
        if not line.strip():
            continue
        if skip:
            found = [k for k in range(at, len(printed)) if printed[k] == line]
            if not found:
                return line
            at = found[0]
        elif at >= len(printed) or printed[at] != line:
            return line
        at, skip = at + 1, False
    return None


def test_the_ring_excerpt_is_the_lowerings():
    text = (ROOT / "docs" / "host-operands.md").read_text()
    block = text.split("never forked from the caller's stream:\n\n```\n", 1)[1].split("```")[0]
    program = cg.lower(cg.examples.offload_linear(torch.bfloat16, 8), staging="ring")
    printed = [line[2:] for line in str(program).splitlines()]  # the body, one level in
    assert _excerpt_mismatch(block.splitlines(), printed) is None


def test_the_runtime_excerpt_is_the_generated_cpp():
    text = (ROOT / "docs" / "runtime.md").read_text()
    block = text.split("```cpp\n", 1)[1].split("```")[0]
    cpp = (ROOT / "csrc_gen" / "two_matmuls.cpp").read_text().splitlines()
    assert _excerpt_mismatch(block.splitlines(), cpp) is None


# ---------------------------------------------------------------------------- examples

EXAMPLE = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
NEEDS_A_GPU = "# needs a GPU"
EXAMPLE_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def examples(doc):
    """The ```python blocks of ``doc``, in order."""
    return EXAMPLE.findall(doc.read_text())


EXAMPLES = [(doc, i) for doc in EXAMPLE_DOCS for i in range(len(examples(doc)))]


def _run_example(doc, i, gpu):
    """Runs the blocks of ``doc`` up to block ``i`` in one namespace, as a reader pasting
    them one after another would (a later block may use what an earlier one made). Blocks
    that need a GPU are compiled, and run only with one."""
    namespace = {"__name__": f"example_{doc.stem}"}
    for k, block in enumerate(examples(doc)[:i + 1]):
        code = compile(block, f"{doc.name}, python block {k + 1}", "exec")
        if block.startswith(NEEDS_A_GPU) and not gpu:
            if k == i:
                pytest.skip(f"{doc.name}, python block {k + 1}: {NEEDS_A_GPU}")
            continue
        exec(code, namespace)


@pytest.mark.build
@pytest.mark.parametrize("doc,i", EXAMPLES, ids=[f"{d.name}-{i + 1}" for d, i in EXAMPLES])
def test_the_python_examples_run_as_shown(doc, i, cache_dir, capsys):
    _run_example(doc, i, torch.cuda.is_available())


def test_examples_are_found_and_those_needing_a_gpu_say_so_first():
    assert len(EXAMPLES) >= 7
    for doc, i in EXAMPLES:
        block = examples(doc)[i]
        if "cuda" in block and "is_available" not in block:
            assert block.startswith(NEEDS_A_GPU + "\n"), f"{doc.name}, python block {i + 1}"
