"""The `ddpkit` command; each subcommand lives in its own module and registers itself here.

    ddpkit launch --nproc-per-node 2 train.py      # or: python -m ddpkit launch ...
    ddpkit bench --models mlp many-small           # per-step time against torch's DDP
    ddpkit timeline t.json --png steps.png         # the summary of a trace written by launch --timeline
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ddpkit.launch import launcher as launch
from ddpkit.timeline import cli as timeline_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddpkit", description="Data-parallel training for PyTorch.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # Each subcommand sets `handler`, a function of the parsed arguments that returns the exit status.
    launch.add_subcommand(subparsers)
    timeline_cli.add_subcommand(subparsers)
    # `ddpkit bench ...` is handed whole to bench.main (see main), which owns its options and --help.
    subparsers.add_parser("bench", add_help=False, help="per-step time of ddpkit's DDP against torch's")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        from ddpkit.bench import runner as bench

        return bench.main(argv[1:], prog="ddpkit bench")
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
