"""Checkpoints: written atomically by rank 0, loaded without unpickling code.

    path = save_checkpoint(out, step, model=m, optimizer=opt, scheduler=sched, trainer_state=state,
                           sampler_state=sampler.state_dict(), comm=comm, world=world, save_total_limit=3)
    found = load_checkpoint(find_latest_checkpoint(out), model=m, optimizer=opt, scheduler=sched, world=world)
    set_rng_state(found.rng_state)           # right before training continues

A checkpoint is the folder ``output_dir/checkpoint-<step>/``:

    model.safetensors        weights of the unwrapped model (safetensors: tensors only, no code)
    optimizer.pt             optimizer.state_dict(), read back with torch.load(weights_only=True)
    scheduler.pt             scheduler.state_dict(), likewise
    sampler_state.json       the data position: {"epoch", "seed", "consumed"}
    rng_state_<rank>.pth     every rank's python / numpy / torch RNG state, likewise
    trainer_state.json       global_step, log_history, ... in the Transformers format

Every rank calls `save_checkpoint` (it gathers the RNG states); rank 0 writes the files into a hidden temporary
folder and renames it into place, so a checkpoint either exists whole or not at all: a save killed half-way leaves
only a ``.tmp-checkpoint-*`` folder that nothing loads and the next save removes. The ranks then meet (rank 0
broadcasts the outcome, so a failed write raises everywhere instead of leaving the others waiting).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import uuid
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_model, save_model

from .comm import Comm
from .env import DistEnv
from .zero_checkpoint import is_sharded, read_into, shard_files, stage_shards

PREFIX = "checkpoint"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
SAMPLER_FILE = "sampler_state.json"
TRAINER_STATE_FILE = "trainer_state.json"
RNG_FILE = "rng_state_{rank}.pth"
_NAME = re.compile(rf"^{PREFIX}-(\d+)$")


# -- RNG ------------------------------------------------------------------------------------------------------

def rng_state() -> dict[str, Any]:
    """This process's random state, in types torch.load(weights_only=True) accepts (no numpy objects)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any] | None) -> None:
    """Restore what `rng_state` returned; None (no state saved for this rank) leaves the generators alone."""
    if state is None:
        return
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state((np_state["kind"], np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["gauss"]))
    torch.set_rng_state(state["cpu"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


# -- finding ----------------------------------------------------------------------------------------------------

def checkpoint_step(path: str) -> int | None:
    """The step of a finished checkpoint folder, or None for anything else (temporary folders included)."""
    match = _NAME.match(os.path.basename(os.path.normpath(path)))
    if match is None or not os.path.isfile(os.path.join(path, TRAINER_STATE_FILE)):
        return None
    return int(match.group(1))


def list_checkpoints(output_dir: str) -> list[str]:
    """Finished checkpoints in output_dir, oldest (lowest step) first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        path = os.path.join(output_dir, name)
        step = checkpoint_step(path)
        if step is not None:
            found.append((step, path))
    return [path for _, path in sorted(found)]


def find_latest_checkpoint(output_dir: str) -> str | None:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


# -- writing ----------------------------------------------------------------------------------------------------

def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str, obj: Any) -> None:
    """Write JSON through a temporary file and a rename, so readers never see half a file."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_weights(model: torch.nn.Module, path: str) -> None:
    """The model's weights as safetensors, atomically (tied weights are stored once)."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    save_model(model, tmp)
    _fsync(tmp)
    os.replace(tmp, path)


def _write_folder(folder: str, model, optimizer, scheduler, trainer_state, sampler_state, rng_states) -> None:
    save_model(model, os.path.join(folder, MODEL_FILE))
    if optimizer is not None:
        torch.save(optimizer.state_dict(), os.path.join(folder, OPTIMIZER_FILE))
    if scheduler is not None:
        torch.save(scheduler.state_dict(), os.path.join(folder, SCHEDULER_FILE))
    if sampler_state is not None:
        write_json(os.path.join(folder, SAMPLER_FILE), sampler_state)
    for rank, state in enumerate(rng_states):
        torch.save(state, os.path.join(folder, RNG_FILE.format(rank=rank)))
    # Last, because a folder without it is not a checkpoint (see checkpoint_step).
    write_json(os.path.join(folder, TRAINER_STATE_FILE), trainer_state)
    for name in os.listdir(folder):
        _fsync(os.path.join(folder, name))
    _fsync(folder)


def remove_stale(output_dir: str) -> None:
    """Delete what killed saves left behind (hidden temporary and trash folders)."""
    for name in os.listdir(output_dir):
        if name.startswith((f".tmp-{PREFIX}-", f".trash-{PREFIX}-")):
            shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)


def rotate_checkpoints(output_dir: str, save_total_limit: int | None,
                       keep: str | tuple[str, ...] | None = None) -> list[str]:
    """Delete the oldest checkpoints beyond save_total_limit (never those in `keep`); the deleted paths."""
    if save_total_limit is None:
        return []
    kept = {os.path.abspath(k) for k in ((keep,) if isinstance(keep, str) else (keep or ()))}
    found = list_checkpoints(output_dir)
    doomed = [p for p in found[:max(0, len(found) - save_total_limit)] if os.path.abspath(p) not in kept]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def _publish(tmp: str, final: str) -> None:
    """Rename the finished temporary folder to its final name (replacing an older save of the same step)."""
    parent = os.path.dirname(final)
    trash = None
    if os.path.exists(final):
        trash = os.path.join(parent, f".trash-{os.path.basename(final)}-{uuid.uuid4().hex[:8]}")
        os.replace(final, trash)
    os.replace(tmp, final)
    _fsync(parent)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def save_checkpoint(output_dir: str, step: int, *, model: torch.nn.Module, trainer_state: dict,
                    comm: Comm, world: DistEnv, optimizer: torch.optim.Optimizer | None = None,
                    scheduler: Any = None, sampler_state: dict | None = None,
                    save_total_limit: int | None = None, keep: tuple[str, ...] = ()) -> str:
    """Write ``output_dir/checkpoint-<step>`` from rank 0 and return its path; call it on every rank.

    model: the unwrapped module (not the DDP wrapper), whose weights are the same on every rank.
    keep: checkpoints that rotation must not delete (the one this run resumed from: a restart names it again).
    """
    rng_states = comm.all_gather_object(rng_state(), what=f"checkpoint-{step} rng")
    final = os.path.join(output_dir, f"{PREFIX}-{step}")
    outcome = None
    tmp = os.path.join(output_dir, f".tmp-{PREFIX}-{step}-{uuid.uuid4().hex[:8]}")
    # ZeRO: every rank writes its own slice of the optimizer state into the folder (ddpkit.zero_checkpoint).
    sharded = is_sharded(optimizer)
    if sharded:
        tmp = comm.broadcast_object(tmp, src=0, what=f"checkpoint-{step} folder")
        outcome = stage_shards(tmp, optimizer, comm, world.is_main, prepare=lambda: remove_stale(output_dir))
    if world.is_main and outcome is None:
        try:
            os.makedirs(output_dir, exist_ok=True)
            if not sharded:
                remove_stale(output_dir)
                os.makedirs(tmp)
            _write_folder(tmp, model, None if sharded else optimizer, scheduler, trainer_state, sampler_state,
                          rng_states)
            _publish(tmp, final)
            rotate_checkpoints(output_dir, save_total_limit, keep=(final, *keep))
        except Exception as exc:  # noqa: BLE001 - reported to every rank below, then raised
            outcome = f"{type(exc).__name__}: {exc}"
    # The barrier: every rank waits for rank 0's write and learns whether it worked.
    outcome = comm.broadcast_object(outcome, src=0, what=f"checkpoint-{step} written")
    if outcome is not None:
        raise RuntimeError(f"rank 0 could not write checkpoint {final}: {outcome}")
    return final


# -- reading ----------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class LoadedCheckpoint:
    path: str
    step: int
    trainer_state: dict
    sampler_state: dict | None
    rng_state: dict | None  # this rank's, or None when the saving world had no such rank
    saved_world_size: int


def _load_tensors(path: str, device: torch.device | str) -> Any:
    # weights_only=True: tensors, numbers, strings and containers only; a file holding code fails to load.
    return torch.load(path, map_location=device, weights_only=True)


def load_checkpoint(path: str, *, model: torch.nn.Module | None = None,
                    optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
                    world: DistEnv | None = None) -> LoadedCheckpoint:
    """Load what `save_checkpoint` wrote into model, optimizer and scheduler (each optional) on this rank.

    The RNG state is returned, not applied: restore it with `set_rng_state` right before training goes on.
    """
    step = checkpoint_step(path)
    if step is None:
        raise FileNotFoundError(f"{path} is not a finished checkpoint folder ({PREFIX}-<step> with "
                                f"{TRAINER_STATE_FILE})")
    device = world.device if world is not None else torch.device("cpu")
    rank = world.rank if world is not None else 0
    if model is not None:
        try:
            load_model(model, os.path.join(path, MODEL_FILE), strict=True, device=str(device))
        except RuntimeError as exc:  # missing, unexpected or differently shaped weights
            found = str(exc).strip().rstrip(".")[:800]
            raise ValueError(f"{path} holds the weights of another model than this {type(model).__name__}: "
                             f"{found}. Resume with the model the checkpoint was written for, or point "
                             "resume_from_checkpoint at a checkpoint of this model") from exc
    if optimizer is not None and (is_sharded(optimizer) or shard_files(path)):
        read_into(path, optimizer, os.path.join(path, OPTIMIZER_FILE))  # only this rank's ranges
    elif optimizer is not None:
        optimizer.load_state_dict(_load_tensors(os.path.join(path, OPTIMIZER_FILE), device))
    if scheduler is not None:
        scheduler.load_state_dict(_load_tensors(os.path.join(path, SCHEDULER_FILE), "cpu"))
    with open(os.path.join(path, TRAINER_STATE_FILE), encoding="utf-8") as f:
        trainer_state = json.load(f)
    sampler_state = None
    if os.path.isfile(os.path.join(path, SAMPLER_FILE)):
        with open(os.path.join(path, SAMPLER_FILE), encoding="utf-8") as f:
            sampler_state = json.load(f)
    rng_file = os.path.join(path, RNG_FILE.format(rank=rank))
    rng = _load_tensors(rng_file, "cpu") if os.path.isfile(rng_file) else None
    saved_world = len([n for n in os.listdir(path) if re.match(r"^rng_state_\d+\.pth$", n)])
    return LoadedCheckpoint(path, step, trainer_state, sampler_state, rng, saved_world)


__all__ = ["LoadedCheckpoint", "find_latest_checkpoint", "list_checkpoints", "load_checkpoint", "rng_state",
           "rotate_checkpoints", "save_checkpoint", "save_weights", "set_rng_state", "write_json"]
