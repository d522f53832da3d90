"""Which checkpoint a run resumes from, which checkpoints rotation must keep for it, and the run's claim on its folder.

    lock = claim_output_dir(output_dir, comm, world.is_main)            # one run at a time; debris swept
    path = choose_checkpoint(resume, output_dir, restart=world.restart)   # None: start afresh
    keep = protected_checkpoints(args.resume_from_checkpoint)            # for save_checkpoint(keep=...)
    trainer_state, sampler_state = restore(path, model=m, optimizer=opt, scheduler=sched, world=world)

The policy, on top of the checkpoint files (ddpkit.checkpoint):
- resume is None/False (start afresh), True (or "true"/"latest": the newest checkpoint in output_dir, which must
  exist) or a checkpoint folder;
- a run the launcher restarted (--max-restarts; restart > 0) continues from the newest checkpoint in output_dir
  when there is one, unless the checkpoint asked for is newer: a restart never goes back to redo work done since;
- the checkpoint the arguments name is never rotated away, because every restart of the job names it again.
"""

from __future__ import annotations

import os
from typing import Any

from . import checkpoint
from .args import ArgumentError
from .comm import Comm, decided_by_main
from .lock import OutputDirLock


def claim_output_dir(output_dir: str, comm: Comm, is_main: bool) -> OutputDirLock:
    """Take output_dir's lock (ddpkit.lock) on rank 0 and sweep the debris of killed saves, which only the
    lock's holder may do; every rank raises alike when another live run holds it. Release it when done."""
    lock = OutputDirLock(output_dir)
    problem = None
    if is_main:
        try:
            lock.acquire()
            checkpoint.remove_stale(output_dir)
        except (OSError, RuntimeError) as exc:
            problem = str(exc)
    problem = decided_by_main(comm, problem, "output_dir lock")
    if problem is not None:
        raise RuntimeError(problem)
    return lock


def choose_checkpoint(resume: str | bool | None, output_dir: str, restart: int = 0) -> str | None:
    """The checkpoint folder to resume from, or None to start afresh (see the module's docstring)."""
    if restart > 0:
        latest = checkpoint.find_latest_checkpoint(output_dir)
        named = resume if isinstance(resume, str) and os.path.isdir(resume) else None
        if latest is not None and (named is None or checkpoint.checkpoint_step(latest) >
                                   (checkpoint.checkpoint_step(named) or -1)):
            return latest
    if resume in (None, False):
        return None
    if resume is True or resume in ("true", "True", "latest"):
        path = checkpoint.find_latest_checkpoint(output_dir)
        if path is None:
            raise ArgumentError("resume_from_checkpoint", f"no checkpoint found in {output_dir}")
        return path
    return str(resume)


def protected_checkpoints(named: str | bool | None) -> tuple[str, ...]:
    """The checkpoints rotation must keep: the one the arguments name (a restart resumes from it again)."""
    return (named,) if isinstance(named, str) else ()


def restore(path: str, *, model, optimizer, scheduler, world, scaler=None) -> tuple[dict[str, Any], dict | None]:
    """Load a checkpoint into model, optimizer, scheduler (and fp16's scaler), and this rank's RNG; its
    trainer_state and sampler position. The RNG is set last: nothing may draw from it before training goes on."""
    loaded = checkpoint.load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler, world=world,
                                        scaler=scaler)
    checkpoint.set_rng_state(loaded.rng_state)
    return loaded.trainer_state, loaded.sampler_state


def read_trainer_state(path: str) -> dict[str, Any]:
    """A checkpoint's trainer_state.json: its progress and plan, read before anything is loaded (a CheckpointError
    naming the file when it cannot be read)."""
    return checkpoint.read_trainer_state(path)


__all__ = ["claim_output_dir", "choose_checkpoint", "protected_checkpoints", "read_trainer_state", "restore"]
