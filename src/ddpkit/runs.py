"""Which training run an output_dir belongs to now, and which run wrote each of its checkpoints.

    run = new_run_id()                          # a launch that starts afresh (or branches off an old checkpoint)
    mark_current(output_dir, run, resumed_from=None)
    current_run(output_dir, job)                # what a restart of that launch continues: this id

Two runs that share an output_dir one after the other (a fresh run started where an earlier one left its
checkpoints) must not mix: a restart of the second (--max-restarts) resuming from the first's newer checkpoint
would finish with the first run's weights, and rotation, counting the first run's higher-numbered checkpoints,
would delete the second's own. So every checkpoint's completion marker names the run that wrote it (its id), and
``output_dir/.ddpkit-run.json`` names the run that last started there: rank 0 writes it at every launch, under
the output_dir's lock (ddpkit.lock), before the first save, with the launch's id (TORCHELASTIC_RUN_ID, the same
in all its restarts). A restart reads that file to know whose checkpoints are its own, and takes it for its
own launch's only when the ids match: a first attempt that failed before recording its run leaves an earlier
launch's there. The policy that uses all this is ddpkit.resume's.
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


def current_run(output_dir: str, job: str | None = None) -> str | None:
    """The id of the run that last started in output_dir, or None (none did, or an older ddpkit's). job: the
    launch asking (DistEnv.job): a run recorded by another launch is not returned, since a restart of this
    launch whose first attempt failed before recording its run must not take up an earlier launch's."""
    try:
        with open(os.path.join(output_dir, RUN_FILE), encoding="utf-8") as f:
            found = json.load(f)
        run, recorded_by = found.get("run"), found.get("job")
    except (OSError, ValueError, AttributeError):
        return None  # a file cut short by a kill reads as no run: a restart then continues the newest checkpoint
    if job is not None and recorded_by != job:
        return None
    return run if isinstance(run, str) else None


def mark_current(output_dir: str, run: str, resumed_from: str | None, job: str | None = None) -> None:
    """Record `run` (started by launch `job`) as output_dir's current run (rank 0, holding the output_dir's
    lock), atomically."""
    os.makedirs(output_dir, exist_ok=True)
    write_json(os.path.join(output_dir, RUN_FILE), {"run": run, "resumed_from": resumed_from, "job": job,
                                                     "started": time.strftime("%Y-%m-%d %H:%M:%S")})


__all__ = ["RUN_FILE", "current_run", "mark_current", "new_run_id"]
