"""Developers: rewrite ``csrc_gen/``, the bundled examples' generated C++, from a checkout.

``python tools/regen.py [--out DIR]`` writes only the files whose text changed and removes
generated files of examples that no longer exist; ``tests/test_build.py`` fails with a
diff (``stale_goldens``) when the checked-in files are stale.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CSRC_GEN = REPO / "csrc_gen"


def golden_sources() -> dict[str, str]:
    """File name -> generated C++ of every bundled example."""
    import codegen as cg
    from codegen.examples import DISTRIBUTED_EXAMPLES, EXAMPLES, QUANTIZED_EXAMPLES

    examples = {**EXAMPLES, **DISTRIBUTED_EXAMPLES, **QUANTIZED_EXAMPLES}
    return {f"{name}.cpp": cg.render(cg.lower(ex.make())) for name, ex in examples.items()}


def regen(out: Path) -> list[str]:
    """Writes the bundled examples' C++ into ``out``, only files whose text changed;
    removes generated files of examples that no longer exist. Returns what changed."""
    out.mkdir(parents=True, exist_ok=True)
    changed = []
    sources = golden_sources()
    for name, text in sources.items():
        path = out / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            changed.append(name)
    for stale in sorted(out.glob("*.cpp")):
        if stale.name not in sources and stale.read_text().startswith("// @generated"):
            stale.unlink()
            changed.append(f"{stale.name} (removed)")
    return changed


def stale_goldens(out: Path) -> str:
    """A unified diff of checked-in sources against freshly generated ones ('' if none)."""
    diffs = []
    for name, text in golden_sources().items():
        path = out / name
        old = path.read_text() if path.exists() else ""
        if old != text:
            diffs += difflib.unified_diff(old.splitlines(True), text.splitlines(True),
                                          f"csrc_gen/{name} (checked in)",
                                          f"csrc_gen/{name} (generated)")
    return "".join(diffs)


def main(argv: list[str] | None = None) -> int:
    """Rewrites ``--out`` (default csrc_gen/); a folder that cannot be written is one line
    on stderr and exit status 1."""
    parser = argparse.ArgumentParser(prog="tools/regen.py", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=CSRC_GEN)
    args = parser.parse_args(argv)
    try:
        changed = regen(args.out)
    except OSError as e:
        print(f"tools/regen.py: {e}", file=sys.stderr)
        return 1
    print("\n".join(f"wrote {args.out / c}" for c in changed) or "csrc_gen is up to date")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))  # the checkout's codegen, not an installed one
    sys.exit(main())
