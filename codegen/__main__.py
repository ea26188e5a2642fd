"""Command line: ``python -m codegen {demo,show,timeline}``, and ``regen``, the
developers' command that rewrites csrc_gen/ (left out of the help)."""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from .examples import DISTRIBUTED_EXAMPLES, EXAMPLES, example

REPO = Path(__file__).resolve().parent.parent
CSRC_GEN = REPO / "csrc_gen"


def golden_sources() -> dict[str, str]:
    """File name -> generated C++ of every bundled example."""
    from .lowering import lower
    from .renderer import render

    examples = {**EXAMPLES, **DISTRIBUTED_EXAMPLES}
    return {f"{name}.cpp": render(lower(ex.make())) for name, ex in examples.items()}


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


def show(name: str, stage: str, copy_stream: bool = False, staging: str = "slots",
         split_contraction: bool | str = False) -> str:
    from . import lowering
    from .renderer import render

    fusion = example(name).make()
    if stage == "ir":
        return f"{fusion}\n\n# after the fusion passes\n{lowering.schedule(fusion)}"
    program = lowering.lower(fusion, copy_stream=copy_stream, staging=staging,
                             split_contraction=split_contraction)
    if stage == "hostir":
        return str(program)
    variants = [program] if program.alternative is None else [program, program.alternative]
    return "\n".join(map(render, variants))


def _positive(text: str) -> int:
    """An argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value}")
    return value


DESCRIPTION = """\
Stream-parallel host programs for PyTorch, compiled to C++ torch ops.
Run the demo, or print a stage of a bundled example, or draw its streams on a GPU.
"""
EPILOG = "python -m codegen COMMAND --help shows a command's options."


def command_line() -> argparse.ArgumentParser:
    """The parser of ``python -m codegen``."""
    parser = argparse.ArgumentParser(prog="python -m codegen", description=DESCRIPTION,
                                     epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    # The metavar names the users' commands; regen, a developer's, is left out of it and,
    # having no help, of the list below it.
    sub = parser.add_subparsers(dest="command", required=True, title="commands",
                                metavar="{demo,show,timeline}")
    d = sub.add_parser("demo", help="define, lower, print, render, build; on a GPU run, "
                                    "check against torch and time it")
    d.add_argument("--size", type=_positive, default=8192, help="m = n = k on the GPU")
    d.add_argument("--slices", type=_positive, default=4)
    r = sub.add_parser("regen", description="Developers: rewrite csrc_gen/ (only files "
                                            "whose text changed).")
    r.add_argument("--out", type=Path, default=CSRC_GEN)
    s = sub.add_parser("show", help="print one stage of a bundled example")
    s.add_argument("example", choices=sorted(EXAMPLES))
    s.add_argument("--stage", choices=("ir", "hostir", "cpp"), default="hostir")
    s.add_argument("--copy-stream", action="store_true",
                   help="lower with copy_stream=True (host-to-device copies on one stream)")
    s.add_argument("--staging", choices=("slots", "ring"), default="slots",
                   help="ring: host slices land in the thread's staging ring, their copies "
                        "running ahead of the caller's stream and across calls")
    s.add_argument("--split-contraction", nargs="?", const=True, choices=("auto",),
                   help="a row-major host weight read by column blocks streams by row blocks "
                        "instead, each slice accumulating onto the output; auto: by the "
                        "blocks codegen.cost estimates faster (both loops printed where that "
                        "depends on the call's extents)")
    t = sub.add_parser("timeline", help="profile an example on the GPU; draw its streams; "
                                        "for host copies, print how much the GEMMs hid")
    t.add_argument("example", choices=sorted(EXAMPLES))
    t.add_argument("--out", type=Path, default=Path("timeline.png"))
    t.add_argument("--size", type=_positive, default=4096)
    t.add_argument("--copy-stream", action="store_true",
                   help="compile with copy_stream=True (host-to-device copies on one stream)")
    t.add_argument("--split-contraction", nargs="?", const=True, choices=("auto",),
                   help="compile with split_contraction=True (or 'auto')")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs a command; a mistake of the user's or the machine's (a schedule, a build, a
    missing GPU, a file) is one line on stderr and exit status 1, not a traceback."""
    from .builder import BuildError
    from .errors import NoGPUError, ScheduleError

    args = command_line().parse_args(argv)
    try:
        return _run(args)
    except (ScheduleError, BuildError, NoGPUError, OSError) as e:
        said = str(e)
        where = "" if said.startswith(f"{args.command}:") else f" {args.command}:"
        print(f"python -m codegen{where} {said}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    if args.command == "regen":
        changed = regen(args.out)
        print("\n".join(f"wrote {args.out / c}" for c in changed) or "csrc_gen is up to date")
        return 0
    if args.command == "show":
        print(show(args.example, args.stage, args.copy_stream, args.staging,
                   args.split_contraction or False))
        return 0
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(args.size, args.slices)
    from .timeline import draw_timeline

    path, report = draw_timeline(args.example, args.out, size=args.size,
                                 copy_stream=args.copy_stream,
                                 split_contraction=args.split_contraction or False)
    print(f"wrote {path}")
    if report:
        print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
