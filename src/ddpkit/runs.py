"""Which training run an output_dir belongs to now, and which run wrote each of its checkpoints.

    run = new_run_id()                          # a launch that starts afresh (or branches off an old checkpoint)
    mark_current(output_dir, run, resumed_from=None)
    current_run(output_dir)                     # what a restart of that launch continues: this id

Two runs that share an output_dir one after the other (a fresh run started where an earlier one left its
checkpoints) must not mix: a restart of the second (--max-restarts) resuming from the first's newer checkpoint
would finish with the first run's weights, and rotation, counting the first run's higher-numbered checkpoints,
would delete the second's own. So every checkpoint's completion marker names the run that wrote it (its id), and
``output_dir/.ddpkit-run.json`` names the run that last started there: rank 0 writes it at every launch, under
the output_dir's lock (ddpkit.lock), before the first save. A restart, which the launcher starts without telling
it anything but the restart count, reads that file to know whose checkpoints are its own. The policy that uses
all this is ddpkit.resume's.
"""

from __future__ import annotations

import json
import os
import time
import uuid

from .checkpoint import write_json

RUN_FILE = ".ddpkit-run.json"


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def current_run(output_dir: str) -> str | None:
    """The id of the run that last started in output_dir, or None (none did, or an older ddpkit's)."""
    try:
        with open(os.path.join(output_dir, RUN_FILE), encoding="utf-8") as f:
            found = json.load(f).get("run")
    except (OSError, ValueError, AttributeError):
        return None  # a file cut short by a kill reads as no run: a restart then continues the newest checkpoint
    return found if isinstance(found, str) else None


def mark_current(output_dir: str, run: str, resumed_from: str | None) -> None:
    """Record `run` as output_dir's current run (rank 0, holding the output_dir's lock), atomically."""
    os.makedirs(output_dir, exist_ok=True)
    write_json(os.path.join(output_dir, RUN_FILE), {"run": run, "resumed_from": resumed_from,
                                                     "started": time.strftime("%Y-%m-%d %H:%M:%S")})


__all__ = ["RUN_FILE", "current_run", "mark_current", "new_run_id"]
