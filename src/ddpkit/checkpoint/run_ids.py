"""Which training run an output_dir belongs to now, and which run wrote each of its checkpoints.

    run = new_run_id()                          # a launch that starts afresh (or branches off an old checkpoint)
    mark_current(output_dir, run, resumed_from=None)
    current_run(output_dir, job)                # what a restart of that launch continues: this id
    call = call_index(output_dir, job, attempt) # the script's second train() call into output_dir: 1
    current_run(output_dir, job, call)          # what that call continues after a restart: its own run
    mark_ended(output_dir, job, call, step)     # the call finished there: its restart resumes no newer one

Two runs that share an output_dir one after the other (a fresh run started where an earlier one left its
checkpoints) must not mix: a restart of the second (--max-restarts) resuming from the first's newer checkpoint
would finish with the first run's weights, and rotation, counting the first run's higher-numbered checkpoints,
would delete the second's own. So every checkpoint's completion marker names the run that wrote it (its id), and
``output_dir/.ddpkit-run.json`` names the run that last started there: rank 0 writes it at every launch, under
the output_dir's lock (ddpkit.checkpoint.output_lock), before the first save, with the launch's id (TORCHELASTIC_RUN_ID, the same
in all its restarts), and the run of each of the launch's train() calls in call order. A restart reads that file
to know whose checkpoints are its own, and takes it for its own launch's only when the ids match: a first attempt
that failed before recording its run leaves an earlier launch's there. A script that trains twice into one
output_dir restarts as a whole: its first call takes up the first call's run, its second the second's. The
policy that uses all this is ddpkit.checkpoint.resume's.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid

from ddpkit.checkpoint.files import write_json

RUN_FILE = ".ddpkit-run.json"


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def _recorded(output_dir: str) -> dict:
    try:
        with open(os.path.join(output_dir, RUN_FILE), encoding="utf-8") as f:
            found = json.load(f)
    except (OSError, ValueError):
        return {}  # a file cut short by a kill reads as no run: a restart then continues the newest checkpoint
    return found if isinstance(found, dict) else {}


def _of_launch(found: dict, job: str | None, name: str) -> list | None:
    """The run file's list `name` (calls, keys, ends) when launch `job` recorded it, else None."""
    value = found.get(name) if job is not None and found.get("job") == job else None
    return value if isinstance(value, list) else None


def current_run(output_dir: str, job: str | None = None, call: int = 0) -> str | None:
    """The id of the run that last started in output_dir, or None (none did, or an older ddpkit's). job: the
    launch asking (DistEnv.job): a run recorded by another launch is not returned, since a restart of this
    launch whose first attempt failed before recording its run must not take up an earlier launch's. call: which
    of that launch's train() calls asks (call_index): the run that call trained in an earlier attempt, or None."""
    found = _recorded(output_dir)
    run, calls = found.get("run"), _of_launch(found, job, "calls")
    if job is not None:
        if found.get("job") != job:
            return None
        if calls is not None:
            run = calls[call] if call < len(calls) else None
        elif call > 0:  # a file that lists no calls records the first call's run
            return None
    return run if isinstance(run, str) else None


def call_index(output_dir: str, job: str | None, attempt: int) -> int:
    """Which train() call of its launch's attempt (the launcher's restart count) this is, from 0: one script may
    train several times into one output_dir, and each call of a restarted script continues its own run. Counted
    in the run file; a launch with no id cannot be told from another, and counts 0."""
    found = _recorded(output_dir)
    if job is None or found.get("job") != job or found.get("attempt") != attempt:
        return 0
    taken = found.get("taken")
    return taken if isinstance(taken, int) and taken > 0 else 0


def call_slot(output_dir: str, job: str | None, position: int, key: str | None) -> int:
    """Which recorded train() call of launch `job` a restarted script's call continues: the `position`-th of its
    attempt (call_index) when that one trained the same (`key`, what it trains: call_key) or nothing says, else
    the first recorded one that did (a script that skips a stage done in the earlier attempt), else a new one."""
    found = _recorded(output_dir)
    keys = _of_launch(found, job, "keys")
    if keys is None or key is None or (position < len(keys) and keys[position] in (key, None)):
        return position
    if key in keys:
        return keys.index(key)
    return max(position, len(_of_launch(found, job, "calls") or []), len(keys))


def call_key(*parts: object) -> str:
    """A short fingerprint of what a train() call trains (its arguments, model, data), for call_slot."""
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:12]


def call_end(output_dir: str, job: str | None, call: int) -> int | None:
    """The step at which train() call `call` of launch `job` finished in an earlier attempt (mark_ended), or
    None: a later call that continued its run (resuming its checkpoint) may have saved newer ones since."""
    ends = _of_launch(_recorded(output_dir), job, "ends")
    end = ends[call] if ends is not None and call < len(ends) else None
    return end if isinstance(end, int) else None


def mark_ended(output_dir: str, job: str | None, call: int, step: int) -> None:
    """Record that train() call `call` of launch `job` finished at `step` (rank 0, holding the lock)."""
    found = _recorded(output_dir)
    if job is None or found.get("job") != job:
        return
    found["ends"] = _put(_of_launch(found, job, "ends") or [], call, step)
    write_json(os.path.join(output_dir, RUN_FILE), found)


def mark_current(output_dir: str, run: str, resumed_from: str | None, job: str | None = None, attempt: int = 0,
                 call: int = 0, slot: int | None = None, key: str | None = None) -> None:
    """Record `run` (started by launch `job`, its train() call `call` in restart `attempt`, continuing recorded
    call `slot`, by default the same, and training `key`) as output_dir's current run (rank 0, holding the
    output_dir's lock), atomically."""
    os.makedirs(output_dir, exist_ok=True)
    found = _recorded(output_dir) if job is not None else {}
    slot = call if slot is None else slot
    calls, keys = _of_launch(found, job, "calls") or [], _of_launch(found, job, "keys") or []
    write_json(os.path.join(output_dir, RUN_FILE), {
        "run": run, "resumed_from": resumed_from, "job": job, "attempt": attempt, "taken": call + 1,
        "calls": _put(calls, slot, run), "keys": _put(keys, slot, key), "ends": _of_launch(found, job, "ends") or [],
        "started": time.strftime("%Y-%m-%d %H:%M:%S")})


def _put(items: list, index: int, value: object) -> list:
    return (items + [None] * index)[:index] + [value] + items[index + 1:]


__all__ = ["RUN_FILE", "call_end", "call_index", "call_key", "call_slot", "current_run", "mark_current", "mark_ended",
           "new_run_id"]
