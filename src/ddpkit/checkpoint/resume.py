"""Which checkpoint a run resumes from, which checkpoints rotation must keep for it, and the run's claim on its folder.

    lock = claim_output_dir(output_dir, comm, world.is_main)            # one run at a time; debris swept
    choice = begin_run(resume, output_dir, world, comm)       # .path None: start afresh; .run: this run's id
    keep = protected_checkpoints(args.resume_from_checkpoint)            # for save_checkpoint(keep=...)
    trainer_state, sampler_state = restore(choice.path, model=m, optimizer=opt, scheduler=sched, world=world)

The policy, on top of the checkpoint files (ddpkit.checkpoint) and the runs that wrote them (ddpkit.checkpoint.run_ids):
- resume is None/False (start afresh), True (or "true"/"latest": the newest checkpoint of the run that last
  started in output_dir, or of any run when that one saved none; one must exist) or a checkpoint folder;
- a launch trains as a run: the run of the checkpoint it resumes from (its continuation), or a new one when it
  starts afresh or resumes from a checkpoint older than that run's newest in output_dir (a branch). Every
  checkpoint names its run, and rotation retires only the current run's: an earlier run's are kept;
- a run the launcher restarted (--max-restarts; restart > 0) continues from the newest checkpoint of its own run
  in output_dir when there is one, unless the checkpoint asked for is newer: a restart never goes back to redo
  work done since, and never takes up another run's checkpoint;
- the checkpoint the arguments name is never rotated away, because every restart of the job names it again.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

from ddpkit.checkpoint import files as checkpoint
from ddpkit.checkpoint import folders, rng_state
from ddpkit.checkpoint import run_ids as runs
from ddpkit.checkpoint.integrity import problems, write_failure
from ddpkit.checkpoint.output_lock import OutputDirLock
from ddpkit.distributed.comm import Comm, decided_by_main
from ddpkit.errors import ArgumentError


def check_whole(path: str) -> None:
    """Raise unless checkpoint `path` holds the optimizer state a resume goes on with. Transformers resumes from a
    save_only_model checkpoint with a new optimizer and its schedule back at step 0: another run than the one saved."""
    if not os.path.isfile(os.path.join(path, checkpoint.OPTIMIZER_FILE)) and not checkpoint.shard_files(path):
        raise checkpoint.CheckpointError(
            f"{path} holds no optimizer state (saved with save_only_model?), so training cannot go on from it "
            "as the run would have; load its weights into the model and train afresh, without resume")


def claim_output_dir(output_dir: str, comm: Comm, is_main: bool) -> OutputDirLock:
    """Take output_dir's lock (ddpkit.checkpoint.output_lock) on rank 0 and sweep the debris of killed saves, which only the
    lock's holder may do; every rank raises alike when another live run holds it. Release it when done."""
    lock = OutputDirLock(output_dir)
    problem = None
    if is_main:
        try:
            lock.acquire()
            folders.remove_stale(output_dir)
        except (OSError, RuntimeError) as exc:
            problem = str(exc)
    problem = decided_by_main(comm, problem, "output_dir lock")
    if problem is not None:
        raise RuntimeError(problem)
    return lock


@dataclasses.dataclass(frozen=True)
class RunChoice:
    """What a launch of the Trainer continues: `path`, the checkpoint to resume from (None: start afresh), and
    `run`, the id of the run it trains as (ddpkit.checkpoint.run_ids); `others`, the checkpoints in output_dir of other runs,
    which this one neither resumes from after a restart nor rotates; `behind`, the newest checkpoint of the
    resumed run when `path` is an older one (this launch then branches off as a run of its own)."""

    path: str | None
    run: str
    others: tuple[str, ...] = ()
    behind: str | None = None
    call: int = 0  # which train() call of its script into output_dir (runs.call_index)


def choose_run(resume: str | bool | None, output_dir: str, restart: int = 0, job: str | None = None,
               call: int = 0) -> RunChoice:
    """The checkpoint and the run of a launch (see the module's docstring). job: the launch's id (DistEnv.job),
    which tells a restart's own run from an earlier launch's; call: which of its script's train() calls into
    output_dir this is (runs.call_index), each of which continues its own run after a restart."""
    own = runs.current_run(output_dir, job, call) if restart > 0 else None
    if restart > 0 and (own is not None or job is None):  # else this launch never recorded a run: as a first try
        # Its own checkpoints, also those a later run's save renamed aside (a script's second train() call into
        # output_dir does so to its first's), and none past the step where this call ended in an earlier attempt
        # (a second call that resumed the first's checkpoint continues its run); no run file: any run's.
        until = runs.call_end(output_dir, job, call) if own is not None else None
        latest = folders.find_latest_checkpoint(output_dir, own, renamed=True, until=until)
        named = resume if isinstance(resume, str) and os.path.isdir(resume) else None
        named_step = checkpoint.folder_step(named) if named is not None else None
        path = latest if latest is not None and (named_step is None or checkpoint.folder_step(latest) >
                                                 named_step) else None
        path = path or _asked(resume, output_dir, own)
        run = own or (folders.checkpoint_run(path) if path else None) or runs.new_run_id()
        return RunChoice(path, run, _others(output_dir, run))
    path = _asked(resume, output_dir, runs.current_run(output_dir))
    run = folders.checkpoint_run(path) if path else None
    behind = _newer_of_run(output_dir, run, path) if run is not None else None
    run = None if behind else run  # past a newer checkpoint of its run: this launch is a branch, a run of its own
    run = run or runs.new_run_id()
    return RunChoice(path, run, _others(output_dir, run), behind)


def _newer_of_run(output_dir: str, run: str, path: str) -> str | None:
    """The newest whole checkpoint of `run` in output_dir past `path`'s step (a corrupt one is no newer state to
    branch from: resuming before it continues the run), or None."""
    step = checkpoint.folder_step(path)
    later = [p for p in folders.list_checkpoints(output_dir, run)
             if (folders.checkpoint_step(p) or 0) > (step if step is not None else float("inf"))]
    return next((p for p in reversed(later) if not problems(p)), None)


def _asked(resume: str | bool | None, output_dir: str, current: str | None) -> str | None:
    """The checkpoint the argument names: None/False none, True (or "true"/"latest") the newest of the run that
    last started in output_dir (of any run when that one saved none), or a folder."""
    if resume in (None, False):
        return None
    if resume is True or resume in ("true", "True", "latest"):
        own = current is not None and folders.list_checkpoints(output_dir, current)
        path = folders.find_latest_checkpoint(output_dir, current if own else None)
        if path is None:
            raise ArgumentError("resume_from_checkpoint", f"no checkpoint found in {output_dir}" if not own else
                                f"no whole checkpoint of the run that last started in {output_dir}: each of its "
                                f"{len(own)} checkpoint(s) is corrupt (the warnings above say how); name one of "
                                "another run to resume from it")
        return path
    return str(resume)


def _others(output_dir: str, run: str) -> tuple[str, ...]:
    return tuple(p for p in folders.list_checkpoints(output_dir) if folders.checkpoint_run(p) != run)


def choose_checkpoint(resume: str | bool | None, output_dir: str, restart: int = 0) -> str | None:
    """The checkpoint folder to resume from, or None to start afresh (choose_run's)."""
    return choose_run(resume, output_dir, restart).path


def begin_run(resume: str | bool | None, output_dir: str, world: Any, comm: Comm, key: str | None = None) -> RunChoice:
    """choose_run on rank 0, which records the run as output_dir's current one (it holds the lock) and says
    what happens to other runs' checkpoints; the same choice on every rank, or the same error: every rank
    reaches the broadcast, whatever rank 0 met (a full disk writing the run file, a folder that is no checkpoint)."""
    outcome: Any = None
    if world.is_main:
        position = runs.call_index(output_dir, world.job, world.restart)
        # The recorded call this one continues after a restart (key: what it trains), or a new record.
        call = runs.call_slot(output_dir, world.job, position, key) if world.restart else position
        # The call's first choice: its first attempt, or a restart of one that failed before choosing.
        first = world.restart == 0 or (world.job is not None and runs.current_run(output_dir, world.job, call) is None)
        try:
            outcome = dataclasses.replace(choose_run(resume, output_dir, world.restart, world.job, call), call=call)
            if outcome.path is not None and checkpoint.folder_step(outcome.path) is None:
                raise FileNotFoundError(f"{outcome.path} is not a finished checkpoint folder ({folders.PREFIX}-"
                                        "<step> holding its completion marker); resume from another one")
            runs.mark_current(output_dir, outcome.run, outcome.path, world.job, world.restart, position, call, key)
        except Exception as exc:  # noqa: BLE001 - every rank raises it alike, below
            outcome = exc
    shared = decided_by_main(comm, _shareable(outcome, output_dir), "resume: which checkpoint and run")
    if not isinstance(shared, RunChoice):
        kind, args = shared
        if world.is_main:
            raise kind(*args) from outcome
        raise kind(*args)
    if world.is_main and first:
        _warn_about_others(shared, output_dir)
    return shared


def end_run(output_dir: str, world: Any, choice: RunChoice, step: int) -> None:
    """Rank 0, when a train() call finished at `step`: recorded, so that a restart of the script resumes that
    call from no later checkpoint of its run (runs.mark_ended). A failure to record it only warns: the restart
    then takes the run's newest, as before."""
    if not world.is_main or world.job is None:
        return
    try:
        runs.mark_ended(output_dir, world.job, choice.call, step)
    except OSError as exc:
        warnings.warn(f"could not record in {output_dir} that this train() call ended at step {step} ({exc}): a "
                      "restart of this script resumes this call from its run's newest checkpoint", RuntimeWarning,
                      stacklevel=4)


def _shareable(outcome: Any, output_dir: str) -> Any:
    """What rank 0 tells the others: its choice, or its error as (type, arguments) that every rank raises."""
    if not isinstance(outcome, BaseException):
        return outcome
    if isinstance(outcome, ArgumentError):
        return ArgumentError, (outcome.field, str(outcome).split(": ", 1)[-1])
    plain = (OSError, FileNotFoundError, NotADirectoryError, PermissionError, ValueError)  # made from one message
    kind = type(outcome) if type(outcome) in plain else RuntimeError
    return kind, (f"rank 0 could not choose the checkpoint to resume from: {write_failure(outcome, output_dir)}",)


def _warn_about_others(choice: RunChoice, output_dir: str) -> None:
    """On rank 0 at a launch's first choice; stacklevel 5 names the user's trainer.train() line (through
    begin_run, Trainer._train and Trainer.train)."""
    if choice.behind is not None:
        warnings.warn(f"resuming from {choice.path}, older than {choice.behind} of the same run: this run branches "
                      f"off as a new one. Its checkpoints are kept: a restart of this run never resumes from them "
                      "and rotation never deletes them; where this run saves a step they also have, theirs is "
                      "renamed checkpoint-<step>.run-<id>", RuntimeWarning, stacklevel=5)
    elif choice.others and choice.path is None:
        names = ", ".join(os.path.basename(p) for p in reversed(choice.others[-3:]))
        warnings.warn(f"{output_dir} holds {len(choice.others)} checkpoint(s) of earlier runs (the newest: {names}); "
                      "this run starts afresh and keeps them: a restart of this run never resumes from them and "
                      "rotation never deletes them; where this run saves a step they also have, theirs is renamed "
                      f"checkpoint-<step>.run-<id>. To continue that run instead, pass resume_from_checkpoint="
                      f"{choice.others[-1]}; to keep runs apart, give each its own output_dir",
                      RuntimeWarning, stacklevel=5)


def protected_checkpoints(named: str | bool | None) -> tuple[str, ...]:
    """The checkpoints rotation must keep: the one the arguments name (a restart resumes from it again)."""
    return (named,) if isinstance(named, str) else ()


def restore(path: str, *, model, optimizer, scheduler, world, scaler=None,
            comm: Comm | None = None) -> tuple[dict[str, Any], dict | None]:
    """Load a checkpoint into model, optimizer, scheduler (and fp16's scaler), and this rank's RNG; its
    trainer_state and sampler position. The RNG is set last: nothing may draw from it before training goes on.
    comm: every rank restores now (they share out checking the checkpoint, see checkpoint.check_loadable)."""
    loaded = checkpoint.load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler, world=world,
                                        scaler=scaler, comm=comm)
    rng_state.set_rng_state(loaded.rng_state)
    return loaded.trainer_state, loaded.sampler_state


def read_trainer_state(path: str) -> dict[str, Any]:
    """A checkpoint's progress and plan (trainer_state.json with ddpkit_state.json over it, or an older ddpkit's
    trainer_state.json alone), read before anything is loaded (a CheckpointError naming the file when one cannot
    be read)."""
    return checkpoint.read_trainer_state(path)


def read_sampler_state(path: str) -> dict[str, Any]:
    """A checkpoint's sampler_state.json (where its epoch stands), read before anything is loaded. Without one
    the position in the data is unknown: a CheckpointError, not a resume that trains on the wrong samples."""
    state = checkpoint.read_sampler_state(path)
    if state is None:
        raise checkpoint.CheckpointError(
            f"{path} has no {checkpoint.SAMPLER_FILE}, so where its run stood in the data is unknown and a resume "
            "would train on the wrong samples: it was not written by ddpkit's Trainer (a Transformers Trainer's "
            "checkpoint?) or was copied in part. Copy the whole folder; or, to start from its weights alone, load "
            "them into the model (model.load_state_dict(safetensors.torch.load_file(...))) and train without "
            "resume_from_checkpoint")
    return state


__all__ = ["RunChoice", "begin_run", "choose_checkpoint", "choose_run", "claim_output_dir", "protected_checkpoints",
           "read_sampler_state", "read_trainer_state", "restore"]
