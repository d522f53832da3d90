"""The `ddpkit` command; each subcommand lives in its own module and registers itself here.

    ddpkit launch --nproc-per-node 2 train.py      # or: python -m ddpkit launch ...
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import launch


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddpkit", description="Data-parallel training for PyTorch.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # Each subcommand sets `handler`, a function of the parsed arguments that returns the exit status.
    launch.add_subcommand(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
