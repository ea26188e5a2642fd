"""The package's folders are the pipeline's stages, and imports only run down the stages.

Every import in ``codegen/**/*.py`` is read with ``ast`` (absolute and relative ones,
``from . import x`` included, and those inside functions), resolved to the module it
names, and mapped to its stage: the folder under ``codegen/`` (``frontend``, ``hostir``,
...), ``base`` for the modules at the top that everything may use (``errors``,
``version``), ``api`` for the package's face (``__init__``, ``__main__``, ``examples``).
The stage order is docs/architecture.md's: an import may only name a module of its own
stage or of a stage before it, so the stages import each other without a cycle."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "codegen"

# Lowest first. A module may import from its own stage and from any stage before it.
STAGES = ("base", "frontend", "hostir", "distributed", "transforms", "runtime", "interp",
          "backend", "jit", "nn", "tools", "api")
BASE = {"errors", "version"}
API = {"__init__", "__main__", "examples"}


def module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def stage(module: str) -> str:
    """The stage of ``codegen[.x[.y]]``."""
    parts = module.split(".")[1:]
    if not parts or parts[0] in API:
        return "api"
    if parts[0] in BASE:
        return "base"
    if parts[0] not in STAGES:
        raise AssertionError(f"{module}: codegen/{parts[0]} is not a stage of {STAGES}; "
                             "add it to docs/architecture.md and to STAGES here")
    return parts[0]


def imports(path: Path, package: Path) -> Iterator[tuple[int, str]]:
    """(line, module) of every import of a codegen module in ``path``."""
    name = module_name(path, package)
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    root = package.name
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == root or a.name.startswith(root + "."):
                    yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module != root and not module.startswith(root + "."):
                continue
            for a in node.names:  # `from . import x`: the module x, where it is one
                sub = f"{module}.{a.name}"
                path_of = package.parent / sub.replace(".", "/")
                is_module = path_of.with_suffix(".py").is_file() or path_of.is_dir()
                yield node.lineno, sub if is_module else module


def arrows(package: Path) -> dict[tuple[str, str], list[str]]:
    """(from stage, to stage) -> where ("path:line imports module"), across stages."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        src = stage(module_name(path, package))
        for line, module in imports(path, package):
            dst = stage(module)
            if dst != src:
                where = f"{path.relative_to(package.parent)}:{line} imports {module}"
                found.setdefault((src, dst), []).append(where)
    return found


def upward(found: dict[tuple[str, str], list[str]]) -> list[str]:
    """The imports that name a later stage."""
    return [w for (src, dst), wheres in found.items()
            if STAGES.index(dst) > STAGES.index(src) for w in wheres]


def cycle(found: dict[tuple[str, str], list[str]]) -> list[str] | None:
    """A cycle of stages, if there is one."""
    graph: dict[str, set[str]] = {}
    for src, dst in found:
        graph.setdefault(src, set()).add(dst)
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(s: str) -> list[str] | None:
        state[s] = 1
        path.append(s)
        for t in sorted(graph.get(s, ())):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state and (c := visit(t)):
                return c
        state[s] = 2
        path.pop()
        return None

    for s in sorted(graph):
        if s not in state and (c := visit(s)):
            return c
    return None


def test_imports_only_run_down_the_stages():
    found = arrows(PACKAGE)
    assert found, "no import across stages found: the reader is broken"
    bad = upward(found)
    assert not bad, ("imports that run up the stages (order: " + " < ".join(STAGES) +
                     "):\n  " + "\n  ".join(bad))


def test_the_stages_import_each_other_without_a_cycle():
    found = cycle(arrows(PACKAGE))
    assert found is None, "a cycle of stages: " + " -> ".join(found or [])


def test_every_folder_is_a_stage_and_the_doc_lists_them_in_order():
    folders = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert folders == set(STAGES) - {"base", "api"}
    doc = (REPO / "docs" / "architecture.md").read_text()
    order = re.search(r"Stage order[^:]*:(.*?)\n\n", doc, re.DOTALL)
    assert order is not None, "docs/architecture.md: no 'Stage order: ...' line"
    assert re.findall(r"`(\w+)`", order.group(1)) == list(STAGES)


def test_the_reader_sees_relative_function_local_and_package_imports(tmp_path):
    """A planted import of each kind is found, and reported as running up."""
    package = tmp_path / "codegen"
    for folder in ("frontend", "jit", "hostir"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "errors.py").write_text("")
    (package / "jit" / "builder.py").write_text("")
    (package / "hostir" / "nodes.py").write_text("")
    (package / "frontend" / "ir.py").write_text(
        "from ..errors import X\n"
        "from .. import hostir\n"
        "def f():\n"
        "    from ..jit.builder import build\n"
        "    import codegen.hostir.nodes\n")
    found = arrows(package)
    assert sorted(found) == [("frontend", "base"), ("frontend", "hostir"), ("frontend", "jit")]
    assert len(upward(found)) == 3
    assert cycle(found) is None
    (package / "hostir" / "nodes.py").write_text("from ..frontend import ir\n")
    assert cycle(arrows(package)) == ["frontend", "hostir", "frontend"]


@pytest.mark.parametrize("module", ["codegen.hostir.nodes", "codegen.frontend.ir"])
def test_ir_modules_hold_no_execution(module):
    """The IRs are data: they import no backend, no interpreter, no cost model."""
    path = PACKAGE / (module.split(".", 1)[1].replace(".", "/") + ".py")
    named = {m for _, m in imports(path, PACKAGE)}
    assert not {m for m in named if stage(m) not in ("base", "frontend", "hostir")}
