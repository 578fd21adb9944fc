"""``python -m nanguard <command>``; ``python -m nanguard <command> --help``
lists a command's options."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanguard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, loaded libraries, each op's devices and CPU code path")
    # demo and doctor parse their own options (add_help=False hands --help to them)
    sub.add_parser("demo", add_help=False,
                   help="a small Hugging Face causal LM trained in fp16 twice, stock and with nanguard, side by side")
    sub.add_parser("doctor", add_help=False,
                   help="audit a model built from a config: python -m nanguard doctor --model-type llama")
    sub.add_parser("replay", add_help=False,
                   help="run a recorded failing step again: python -m nanguard replay PATH [--triage] [--json]")
    sub.add_parser("study", add_help=False,
                   help="why some seeds diverge: a seed grid, early predictors and LR sensitivity per fix")
    args, rest = parser.parse_known_args(argv)
    if args.command == "info":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        import nanguard

        nanguard.info()
        return 0
    if args.command == "demo":
        from . import demo

        return demo.main(rest)
    if args.command == "doctor":
        from .diagnostics._cli import cli_main

        return cli_main(rest)
    if args.command == "replay":
        from .diagnostics._replay import cli

        return cli(rest)
    if args.command == "study":
        from ._study import main as study_main

        return study_main(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
