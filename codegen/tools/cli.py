"""Command line: ``python -m codegen {demo,show,timeline}``. (Developers regenerate
``csrc_gen/`` with ``python tools/regen.py`` from a checkout.)"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .examples import EXAMPLES, example


def show(name: str, stage: str, copy_stream: bool = False, staging: str = "slots",
         split_contraction: bool | str = False) -> str:
    from ..backend.renderer import render
    from ..transforms import lowering

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
    sub = parser.add_subparsers(dest="command", required=True, title="commands",
                                metavar="{demo,show,timeline}")
    d = sub.add_parser("demo", help="define, lower, print, render, build; on a GPU run, "
                                    "check against torch and time it")
    d.add_argument("--size", type=_positive, default=8192, help="m = n = k on the GPU")
    d.add_argument("--slices", type=_positive, default=4)
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
                        "blocks codegen.transforms.cost estimates faster (both loops printed "
                        "where that depends on the call's extents)")
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
    from ..errors import NoGPUError, ScheduleError
    from ..jit import BuildError

    args = command_line().parse_args(argv)
    try:
        return _run(args)
    except (ScheduleError, BuildError, NoGPUError, OSError) as e:
        said = str(e)
        where = "" if said.startswith(f"{args.command}:") else f" {args.command}:"
        print(f"python -m codegen{where} {said}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
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
