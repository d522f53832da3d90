"""What a timeline request is, as the launcher hands it to its workers: the trace file and the steps to record.

    ddpkit launch --timeline t.json --timeline-steps 3:8 train.py    # DDPKIT_TIMELINE={"file": ..., "steps": "3:8"}

Pure and free of torch, so that the launcher (which imports no torch to start) and env.py (the one reader of the
launcher's variables) share it.
"""

from __future__ import annotations

import json
import os

ENV_VAR = "DDPKIT_TIMELINE"
# After warm-up: step 1 learns the buckets (one extra broadcast, no overlap) and step 2 still pays first-touch
# allocations, so a window from step 3 shows the steady state; six steps are enough to see a straggler repeat.
DEFAULT_STEPS = "3:8"


def parse_steps(text: str) -> tuple[int, int]:
    """"A:B" -> (A, B): optimizer steps A to B, both included, 1 <= A <= B."""
    first, sep, last = str(text).partition(":")
    try:
        steps = int(first), int(last)
    except ValueError:
        steps = None
    if not sep or steps is None or not 1 <= steps[0] <= steps[1]:
        raise ValueError(f"timeline steps must be A:B with 1 <= A <= B (optimizer steps, both included, e.g. "
                         f"{DEFAULT_STEPS}); got {text!r}")
    return steps


def encode(path: str, steps: str | None) -> str:
    """The value of DDPKIT_TIMELINE for a trace written to `path` (made absolute: workers may change folder)."""
    parse_steps(steps or DEFAULT_STEPS)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"the folder of the timeline file {path!r} does not exist ({folder}); create it first")
    return json.dumps({"file": os.path.abspath(path), "steps": steps or DEFAULT_STEPS})


def decode(value: str) -> tuple[str, tuple[int, int]]:
    """(trace file, (A, B)) from DDPKIT_TIMELINE."""
    try:
        found = json.loads(value)
        path, steps = found["file"], found.get("steps", DEFAULT_STEPS)
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{ENV_VAR}={value!r} is not what ddpkit launch --timeline sets "
                         '({"file": PATH, "steps": "A:B"})') from None
    return str(path), parse_steps(steps)


def summary_path(trace_path: str) -> str:
    """Where the summary of a trace is written: t.json -> t.summary.json."""
    stem = trace_path[:-5] if trace_path.endswith(".json") else trace_path
    return stem + ".summary.json"
