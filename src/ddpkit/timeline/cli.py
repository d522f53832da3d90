"""`ddpkit timeline FILE`: the summary of a saved trace again, and a picture of it.

    ddpkit timeline t.json                    # the summary printed when the trace was written
    ddpkit timeline t.json --png steps.png    # per step and per rank: compute, exposed communication, data wait
    ddpkit timeline t.json --json s.json      # the summary's numbers as JSON
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ddpkit._utils.atomic import replacing
from ddpkit.timeline.spec import output_path_problem
from ddpkit.timeline.summary import format_summary, summarize
from ddpkit.timeline.trace import write_json

# (field, legend, colour): the parts a step's time is split into, bottom to top of each bar.
PARTS = (("compute_ms", "compute", "#4c72b0"), ("exposed_comm_ms", "exposed communication", "#c44e52"),
         ("data_wait_ms", "data wait", "#dd8452"), ("untracked_ms", "untracked", "#b0b0b0"))


def add_subcommand(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("timeline", help="summarise a trace written by --timeline",
                                   description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("file", help="a trace written by ddpkit launch --timeline or ddp_timeline_steps")
    parser.add_argument("--png", metavar="OUT", help="also draw the per-step breakdown into this PNG (matplotlib)")
    parser.add_argument("--json", metavar="OUT", help="also write the summary's numbers into this JSON file")
    parser.set_defaults(handler=main)
    return parser


def main(args: argparse.Namespace) -> int:
    from ddpkit.timeline.recorder import load_trace

    outputs = [(option, out) for option, out in (("--json", args.json), ("--png", args.png)) if out]
    for option, out in outputs:
        clash = [name for name, other in [("the trace", args.file), *outputs] if name != option and
                 os.path.abspath(other) == os.path.abspath(out)]
        if clash:  # the summary would replace the trace, or one output the other
            return _fail(f"{option} {out!r} names the same file as {clash[0]}; write each to a file of its own")
        problem = output_path_problem(out)
        if problem is not None:  # before any work, as a mistyped path is found
            return _fail(f"{option} {out!r} {problem}; pass the path of a file to write, in a folder that exists "
                         "and that you can write in")
    try:
        trace = load_trace(args.file)
    except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        return _fail(f"cannot read {args.file}: {exc}")
    summary = summarize(trace)
    print(format_summary(summary))
    try:
        if args.json:
            write_json(args.json, summary, indent=1)
        if args.png:
            try:
                import matplotlib
            except ImportError:
                print("ddpkit timeline: --png needs matplotlib: pip install matplotlib", file=sys.stderr)
                return 1
            matplotlib.use("Agg")
            draw(summary, args.png)
            print(f"wrote {args.png}")
    except OSError as exc:  # the folder went away or filled up since the check above
        return _fail(f"cannot write {exc.filename or 'the output'}: {exc.strerror or exc}")
    return 0


def _fail(message: str) -> int:
    """One line on stderr, and the exit status of a usage error."""
    print(f"ddpkit timeline: {message}", file=sys.stderr)
    return 2


def draw(summary: dict[str, Any], path: str) -> None:
    """Stacked bars: each step (mean over the ranks), then each rank's mean step; communication as a mark."""
    import matplotlib.pyplot as plt

    steps = summary["steps"]
    per_rank = sorted(summary["total"]["per_rank"].items(), key=lambda kv: int(kv[0])) if steps else []
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 1]})
    _bars(left, [str(s["step"]) for s in steps], [s["mean"] for s in steps], "optimizer step")
    left.set_title("per step, mean over the ranks")
    left.set_ylabel("ms")
    rows = [{k: v / max(1, len(steps)) for k, v in row.items()} for _, row in per_rank]
    _bars(right, [f"rank {r}" for r, _ in per_rank], rows, "")
    right.set_title("mean step, per rank")
    handles, names = left.get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=len(names), fontsize=8, frameon=False)
    fig.suptitle(f"ddpkit timeline: {len(summary['ranks'])} rank(s), steps {summary['steps_asked'][0]} to "
                 f"{summary['steps_asked'][1]}")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    try:
        with replacing(path, "wb") as f:  # the temporary's name hides the extension: say the format
            fig.savefig(f, format="png", dpi=110)
    finally:
        plt.close(fig)


def _bars(ax, labels: list[str], rows: list[dict[str, float]], xlabel: str) -> None:
    bottom = [0.0] * len(rows)
    x = list(range(len(rows)))
    for field, legend, colour in PARTS:
        values = [max(0.0, r[field]) for r in rows]
        ax.bar(x, values, bottom=bottom, color=colour, label=legend, width=0.7)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.plot(x, [r["comm_ms"] for r in rows], "k_", markersize=18, label="all communication")
    ax.set_xticks(x, labels)
    ax.set_xlabel(xlabel)
