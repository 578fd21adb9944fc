"""``python -m nanguard <command>``."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanguard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, loaded libraries, and the devices of every op")
    args = parser.parse_args(argv)
    import nanguard

    if args.command == "info":
        nanguard.info()
    return 0


if __name__ == "__main__":
    sys.exit(main())
