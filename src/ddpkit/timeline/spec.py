"""What a timeline request is, as the launcher hands it to its workers: the trace file and the steps to record.

    ddpkit launch --timeline t.json --timeline-steps 3:8 train.py    # DDPKIT_TIMELINE={"file": ..., "steps": "3:8"}

Pure and free of torch, so that the launcher (which imports no torch to start) and the workers share it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from ddpkit.distributed.variables import TIMELINE_VAR

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


def output_path_problem(path: str, make_folder: bool = False) -> str | None:
    """Why a file (a trace, a summary, a picture) cannot be written to `path`, worded to follow the path ("'x' is a
    folder"), or None when it can.

    The trace is written only after the window, from inside an optimizer step, so its path is checked before any
    training starts: it must name a file, not a folder, whose folder exists (or, with `make_folder`, can be created
    under the nearest one that does) and lets this process create files (the write is a temporary file renamed).
    """
    full = os.path.abspath(path)
    if os.path.isdir(full):
        return "is a folder, not a file"
    if os.path.lexists(full) and not os.path.isfile(full):
        return "exists and is not a regular file"
    folder = existing = os.path.dirname(full)
    while make_folder and not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.lexists(existing):
        return f"is in a folder that does not exist ({folder})"
    if not os.path.isdir(existing):
        return f"is under {existing}, which is not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"is in a folder this process may not write in ({existing})"
    return None


def encode(path: str, steps: str | None) -> str:
    """The value of DDPKIT_TIMELINE for a trace written to `path` (made absolute: workers may change folder)."""
    parse_steps(steps or DEFAULT_STEPS)
    problem = output_path_problem(path)
    if problem is not None:
        example = os.path.join(path, "timeline.json") if os.path.isdir(path) else "timeline.json"
        raise ValueError(f"--timeline {path!r} {problem}; pass the path of the JSON file to write, in a folder "
                         f"that exists and that you can write in (e.g. --timeline {example})")
    return json.dumps({"file": os.path.abspath(path), "steps": steps or DEFAULT_STEPS})


def decode(value: str) -> tuple[str, tuple[int, int]]:
    """(trace file, (A, B)) from DDPKIT_TIMELINE."""
    try:
        found = json.loads(value)
        path, steps = found["file"], found.get("steps", DEFAULT_STEPS)
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{TIMELINE_VAR}={value!r} is not what ddpkit launch --timeline sets "
                         '({"file": PATH, "steps": "A:B"})') from None
    return str(path), parse_steps(steps)


def summary_path(trace_path: str) -> str:
    """Where the summary of a trace is written: t.json -> t.summary.json."""
    stem = trace_path[:-5] if trace_path.endswith(".json") else trace_path
    return stem + ".summary.json"


def request(environ: Mapping[str, str] | None = None) -> tuple[str, tuple[int, int]] | None:
    """What `ddpkit launch --timeline FILE --timeline-steps A:B` asked of this worker: (FILE, (A, B)), or None."""
    value = (os.environ if environ is None else environ).get(TIMELINE_VAR)
    return decode(value) if value else None
