"""Checkpoints: written atomically by rank 0, loaded without unpickling code.

    theirs, ours = state.split(args.per_device_train_batch_size)
    path = save_checkpoint(out, step, model=m, optimizer=opt, scheduler=sched, trainer_state=theirs,
                           ddpkit_state=ours, sampler_state=sampler.state_dict(), comm=comm, world=world,
                           save_total_limit=3)
    found = load_checkpoint(find_latest_checkpoint(out), model=m, optimizer=opt, scheduler=sched, world=world)
    set_rng_state(found.rng_state)           # right before training continues

A checkpoint is the folder ``output_dir/checkpoint-<step>/``:

    model.safetensors        weights of the unwrapped model (safetensors: tensors only, no code)
    config.json              a Transformers model's configuration: from_pretrained(the folder) loads the model
    tokenizer.json, ...      the Trainer's processing_class, by its save_pretrained (AutoTokenizer loads it)
    optimizer.pt             optimizer.state_dict(), read back with torch.load(weights_only=True)
    scheduler.pt             scheduler.state_dict(), likewise
    scaler.pt                fp16's GradScaler.state_dict() (the loss scale; only with fp16), likewise
    sampler_state.json       the data position: {"epoch", "seed", "consumed"} (+ "group_size": group_by_length)
    training_args.bin        the Trainer's TrainingArguments, torch.save'd, as Transformers writes them (for
                             scripts that read them back; ddpkit never loads it: it is a pickle)
    rng_state_<rank>.pth     every rank's python / numpy / torch RNG state, likewise (a world of one writes it
                             also as rng_state.pth, the name a Transformers Trainer of one process reads)
    trainer_state.json       global_step, log_history, ...: Transformers' TrainerState fields alone, so that
                             transformers.TrainerState.load_from_json (and Transformers' Trainer) reads it
    ddpkit_state.json        ddpkit's progress beyond them: the running loss sums, the plan's arguments, the world
                             size, the global batch as train_batch_size, ... read back over trainer_state.json
                             (state.TrainerState.split; an older ddpkit wrote none: all was in trainer_state.json)
    checkpoint_complete.json the completion marker, written last: every file above with its size and CRC-32

Every rank calls `save_checkpoint` (it gathers the RNG states); rank 0 writes the files into a hidden temporary
folder and renames it into place, so a checkpoint either exists whole or not at all: a save killed half-way leaves
only a ``.tmp-checkpoint-*`` folder that nothing loads and the next save removes. The ranks then meet (rank 0
broadcasts the outcome, so a failed write raises everywhere instead of leaving the others waiting). Rotation
retires an old checkpoint by renaming it to a hidden ``.trash-*`` name first and deleting it after, so a kill
never leaves a folder that looks finished but does not load. Loading checks the folder against its marker first
(see `ddpkit.checkpoint.integrity`) and names the file that is missing, truncated or corrupt (its checksum included). A
checkpoint folder renamed away from ``checkpoint-<step>`` still loads when named (its step is in its marker); only
finding, listing and rotation go by the name.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
import uuid
import zlib
from typing import Any

import torch

from ddpkit._utils.atomic import replacing, replacing_path
from ddpkit.checkpoint.folders import (DDPKIT_STATE_FILE, PREFIX, TRAINER_STATE_FILE, aside_name, checkpoint_run,
                                       checkpoint_step, fsync_path, remove_stale, rotate_checkpoints)
from ddpkit.checkpoint.integrity import (MARKER_FILE, file_crc32, manifest, problems, read_marker, write_checksummed,
                                         write_failure, write_failures)
from ddpkit.checkpoint.model_weights import load_weights_file, save_weights_file
from ddpkit.checkpoint.rng_state import numpy_allowed, rng_state
from ddpkit.checkpoint.sharded import foreign_state, is_sharded, read_into, shard_files, shard_index, stage_shards
from ddpkit.distributed.comm import Comm, gather_objects
from ddpkit.distributed.env import DistEnv
from ddpkit.errors import CheckpointError

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"  # a Transformers model's configuration (PretrainedConfig.save_pretrained writes it)
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
SCALER_FILE = "scaler.pt"  # Transformers' name for the GradScaler's state
SAMPLER_FILE = "sampler_state.json"
RNG_FILE = "rng_state_{rank}.pth"
SINGLE_RNG_FILE = "rng_state.pth"  # a Transformers Trainer's, in a world of one: it reads no other there
TRAINING_ARGS_FILE = "training_args.bin"  # the TrainingArguments, pickled, as Transformers' Trainer saves them


# -- writing ----------------------------------------------------------------------------------------------------

def write_json(path: str, obj: Any) -> int:
    """Write JSON through a temporary file and a rename, so readers never see half a file; its bytes' CRC-32."""
    data = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8")
    with replacing(path, "wb", durable=True) as f:
        f.write(data)
    return zlib.crc32(data)


def save_weights(model: torch.nn.Module, path: str) -> None:
    """The model's weights as safetensors, atomically (ddpkit.checkpoint.model_weights: tied weights are stored once)."""
    with replacing_path(path, durable=True) as tmp:
        save_weights_file(model, tmp)


def _write_folder(folder: str, step: int, model, optimizer, scheduler, trainer_state, sampler_state, rng_states,
                  scaler=None, crc32: dict[str, int] | None = None, run: str | None = None,
                  ddpkit_state: dict | None = None, processor: Any = None, training_args: Any = None) -> None:
    """Every file but ZeRO's shards, then the marker with every file's CRC-32 (crc32: the shards', which their
    ranks computed) and the id of the run that wrote it (ddpkit.checkpoint.run_ids)."""
    sums = dict(crc32 or {})
    processed = _save_processor(processor, folder)  # first: a name ddpkit writes too (config.json) is then ddpkit's
    save_weights_file(model, os.path.join(folder, MODEL_FILE))
    # safetensors writes the file itself (in Rust), so its checksum is read back once, from the page cache.
    sums[MODEL_FILE] = file_crc32(os.path.join(folder, MODEL_FILE))
    for name, config in _configs(model).items():  # from_pretrained(the folder) loads it, as a Transformers one
        config.save_pretrained(folder)
        sums[name] = file_crc32(os.path.join(folder, name))
    # The scaler is the same on every rank: the ranks agree on every skip (ddpkit.trainer.precision).
    for name, source in ((SCALER_FILE, scaler), (OPTIMIZER_FILE, optimizer), (SCHEDULER_FILE, scheduler)):
        if source is not None:
            saved = source.state_dict()
            sums[name] = write_checksummed(os.path.join(folder, name), functools.partial(torch.save, saved))
    if sampler_state is not None:
        sums[SAMPLER_FILE] = write_json(os.path.join(folder, SAMPLER_FILE), sampler_state)
    if training_args is not None:
        sums[TRAINING_ARGS_FILE] = write_checksummed(os.path.join(folder, TRAINING_ARGS_FILE),
                                                     functools.partial(torch.save, training_args))
    for rank, state in enumerate(rng_states):
        for name in [RNG_FILE.format(rank=rank)] + [SINGLE_RNG_FILE] * (len(rng_states) == 1):
            sums[name] = write_checksummed(os.path.join(folder, name), functools.partial(torch.save, state))
    if ddpkit_state is not None:
        sums[DDPKIT_STATE_FILE] = write_json(os.path.join(folder, DDPKIT_STATE_FILE), ddpkit_state)
    sums[TRAINER_STATE_FILE] = write_json(os.path.join(folder, TRAINER_STATE_FILE), trainer_state)
    sums.update({name: file_crc32(os.path.join(folder, name)) for name in processed if name not in sums})
    names = sorted(_files_in(folder))
    for name in names:
        fsync_path(os.path.join(folder, name))
    for sub in {os.path.dirname(name) for name in names} - {""}:  # a processor's subfolders: their entries too
        fsync_path(os.path.join(folder, sub))
    # Last, once every other byte is on disk: a folder without the marker is not a checkpoint (checkpoint_step).
    marker = manifest(folder, names, step, crc32=sums)
    write_json(os.path.join(folder, MARKER_FILE), marker if run is None else {**marker, "run": run})
    fsync_path(folder)


def _save_processor(processor: Any, folder: str) -> set[str]:
    """The Trainer's processing_class (a tokenizer) saved by its save_pretrained into the folder: the files it
    wrote, whatever they are, in subfolders too (a tokenizer's additional_chat_templates/); none without one."""
    if processor is None:
        return set()
    before = _files_in(folder)
    processor.save_pretrained(folder)
    return _files_in(folder) - before


def _files_in(folder: str) -> set[str]:
    """Every file under `folder`, as a path relative to it (the marker's names: a/b for a subfolder's)."""
    return {os.path.relpath(os.path.join(root, name), folder) for root, _, files in os.walk(folder) for name in files}


def _configs(model: torch.nn.Module) -> dict[str, Any]:
    """A Transformers model's configurations by file, as its save_pretrained writes them: config.json naming its
    class (`architectures`), and generation_config.json for a model that generates."""
    config = getattr(model, "config", None)
    if not callable(getattr(config, "save_pretrained", None)):
        return {}
    config.architectures = [type(model).__name__]  # save_pretrained's own, which the Auto classes read
    found = {CONFIG_FILE: config}
    generation = getattr(model, "generation_config", None)
    if callable(getattr(model, "can_generate", None)) and model.can_generate() and generation is not None:
        found["generation_config.json"] = generation
    return found


def _publish(tmp: str, final: str, run: str | None = None) -> None:
    """Rename the finished temporary folder to its final name. An older save of the same step is replaced when it
    is this run's; another run's is renamed aside to ``checkpoint-<step>.run-<its id>``, kept (ddpkit.checkpoint.run_ids)."""
    parent = os.path.dirname(final)
    trash = aside = None
    if os.path.exists(final):
        owner = checkpoint_run(final)
        if run is not None and owner != run:
            aside = aside_name(final, owner)
            aside = aside if not os.path.exists(aside) else f"{aside}-{uuid.uuid4().hex[:8]}"
        else:
            trash = os.path.join(parent, f".trash-{os.path.basename(final)}-{uuid.uuid4().hex[:8]}")
        os.replace(final, aside or trash)
    os.replace(tmp, final)
    fsync_path(parent)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def save_checkpoint(output_dir: str, step: int, *, model: torch.nn.Module, trainer_state: dict,
                    comm: Comm, world: DistEnv, optimizer: torch.optim.Optimizer | None = None,
                    scheduler: Any = None, sampler_state: dict | None = None,
                    save_total_limit: int | None = None, keep: tuple[str, ...] = (), scaler: Any = None,
                    run: str | None = None, rng: bool = True, ddpkit_state: dict | None = None,
                    processor: Any = None, training_args: Any = None) -> str:
    """Write ``output_dir/checkpoint-<step>`` from rank 0 and return its path; call it on every rank.

    model: the unwrapped module (not the DDP wrapper), whose weights are the same on every rank.
    keep: checkpoints that rotation must not delete (the one this run resumed from: a restart names it again).
    run: the training run's id, written into the marker; rotation then retires only that run's checkpoints.
    rng: whether to write every rank's RNG state (False: a checkpoint of the weights, save_only_model's, that
    nothing resumes from; every rank must pass the same, as the gather is skipped).
    trainer_state, ddpkit_state: trainer_state.json's content and ddpkit_state.json's (none: no such file), as
    TrainerState.split makes them; read back as one by read_trainer_state.
    processor: the Trainer's processing_class (a tokenizer, say), saved into the folder by its save_pretrained.
    """
    rng_states = comm.all_gather_object(rng_state(), what=f"checkpoint-{step} rng") if rng else []
    final = os.path.join(output_dir, f"{PREFIX}-{step}")
    tmp = os.path.join(output_dir, f".tmp-{PREFIX}-{step}-{uuid.uuid4().hex[:8]}")
    sharded, failures, shard_sums = is_sharded(optimizer), [], {}
    if sharded:  # ZeRO: every rank writes its own slice of the optimizer state into the folder (zero_checkpoint)
        tmp = comm.broadcast_object(tmp, src=0, what=f"checkpoint-{step} folder")
        failures, shard_sums = stage_shards(tmp, optimizer, comm, world.is_main,
                                            prepare=lambda: remove_stale(output_dir))
    if world.is_main and not failures:
        try:
            os.makedirs(output_dir, exist_ok=True)
            if not sharded:
                remove_stale(output_dir)
                os.makedirs(tmp)
            _write_folder(tmp, step, model, None if sharded else optimizer, scheduler, trainer_state,
                          sampler_state, rng_states, scaler, shard_sums, run, ddpkit_state, processor, training_args)
            _publish(tmp, final, run)
            # None past this step: a later train() call's of the same run, in a restarted script (rotate's until)
            rotate_checkpoints(output_dir, save_total_limit, keep=(final, *keep), run=run, until=step)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below, then raised
            failures = [(0, write_failure(exc, output_dir))]
    if failures and world.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # a half-written folder only takes space: the older ones stay
    # The barrier: every rank waits for rank 0's write and learns whether it (and every shard) worked.
    failures = comm.broadcast_object(failures, src=0, what=f"checkpoint-{step} written")
    if failures:
        raise write_failures(final, failures)
    return final


# -- reading ----------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class LoadedCheckpoint:
    path: str
    step: int
    trainer_state: dict  # read_trainer_state's: both progress files as one
    sampler_state: dict | None
    rng_state: dict | None  # this rank's, or None when the saving world had no such rank
    saved_world_size: int


def _load_tensors(path: str, device: torch.device | str) -> Any:
    # weights_only=True: tensors, numbers, strings and containers only; a file holding code fails to load.
    return torch.load(path, map_location=device, weights_only=True)


def folder_step(path: str) -> int | None:
    """The step of a checkpoint folder named to be loaded: `checkpoint_step`'s, or for a folder renamed away from
    checkpoint-<step> (``mv out/checkpoint-500 best_run``) the step its completion marker records (else its
    trainer_state.json's global_step). None: not a finished checkpoint."""
    step = checkpoint_step(path)
    if step is not None or not os.path.isfile(os.path.join(path, MARKER_FILE)):
        return step
    try:
        step = read_marker(path).get("step")
        if not isinstance(step, int) or step < 0:  # an older ddpkit wrote trainer_state's global_step, or -1
            step = read_trainer_state(path).get("global_step")
    except (CheckpointError, AttributeError):
        return None  # check_loadable names what cannot be read
    return step if isinstance(step, int) and step >= 0 else None


def check_loadable(path: str, *, optimizer: bool = False, scheduler: bool = False, comm: Comm | None = None) -> None:
    """Raise CheckpointError naming every missing, truncated or corrupt file of checkpoint `path` (and the
    optimizer or scheduler file, when they are to be loaded and were never saved).

    Every file is read whole for its checksum, ZeRO's optimizer shards only when the optimizer is loaded. comm:
    the ranks loading together (every one of them calls this): each then reads only every world_size-th shard
    and they share what they found, so the shards are read once between them, not once each, and every rank
    raises alike."""
    step = folder_step(path)
    if step is None and not os.path.isfile(os.path.join(path, MARKER_FILE)):
        raise FileNotFoundError(f"{path} is not a finished checkpoint folder (one holding {MARKER_FILE}, or an "
                                f"older ddpkit's {PREFIX}-<step> holding {TRAINER_STATE_FILE}); resume from "
                                "another one")
    shared = comm is not None and comm.distributed

    def checksum(name: str) -> bool:
        shard = shard_index(name)
        return shard is None or (optimizer and (not shared or shard % comm.world_size == comm.rank))

    wrong = problems(path, checksum)
    if shared:
        wrong = sorted({w for found in gather_objects(comm, wrong, f"checkpoint check {path}") for w in found})
    if step is None and not wrong:
        wrong.append(f"neither {MARKER_FILE} nor {TRAINER_STATE_FILE} records its step")
    for wanted, name in ((optimizer, OPTIMIZER_FILE), (scheduler, SCHEDULER_FILE)):
        there = os.path.isfile(os.path.join(path, name)) or (name == OPTIMIZER_FILE and shard_files(path))
        if wanted and not there and f"{name} is missing" not in wrong:
            wrong.append(f"{name} is missing (this checkpoint was saved without it)")
    if wrong:
        raise CheckpointError(f"checkpoint {path} cannot be loaded: " + "; ".join(wrong)
                              + ". Resume from another checkpoint (resume_from_checkpoint=true takes the newest "
                              "whole one)")


def read_trainer_state(path: str) -> dict:
    """The progress saved in checkpoint `path`, as the run held it (TrainerState.to_dict's names and meanings):
    its trainer_state.json with ddpkit_state.json's fields over it, where it has one (an older ddpkit's held it all
    in trainer_state.json); or a CheckpointError that names the file that cannot be read."""
    extra = os.path.join(path, DDPKIT_STATE_FILE)
    ours = _read_json(extra) if os.path.isfile(extra) else {}
    return {**_read_json(os.path.join(path, TRAINER_STATE_FILE)), **ours}


def read_sampler_state(path: str) -> dict | None:
    """The sampler_state.json of checkpoint `path`; None when it has none."""
    file = os.path.join(path, SAMPLER_FILE)
    return _read_json(file) if os.path.isfile(file) else None


def _read_json(file: str) -> Any:
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file} cannot be read: {exc}") from exc


def _load_into(target: Any, file: str, device: torch.device | str) -> None:
    try:
        state = _load_tensors(file, device)
    except Exception as exc:  # noqa: BLE001 - whatever the unpickler says, name the file first
        raise CheckpointError(f"{file} cannot be read: {type(exc).__name__}: {exc}") from exc
    if isinstance(target, torch.optim.Optimizer):
        _check_hyperparameters(target, state, file)
    try:
        target.load_state_dict(state)
    except (ValueError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"{file} does not fit this {type(target).__name__}: {exc}. Resume with the "
                              "optimizer and scheduler the checkpoint was written with") from exc


def _check_hyperparameters(optimizer: torch.optim.Optimizer, state: Any, file: str) -> None:
    groups = state.get("param_groups") if isinstance(state, dict) else None
    foreign = foreign_state(optimizer, groups[0]) if groups else None
    if foreign:
        raise CheckpointError(f"{file} holds {foreign}")


def load_checkpoint(path: str, *, model: torch.nn.Module | None = None,
                    optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
                    world: DistEnv | None = None, scaler: Any = None, comm: Comm | None = None) -> LoadedCheckpoint:
    """Load what `save_checkpoint` wrote into model, optimizer and scheduler (each optional) on this rank.

    The folder is checked against its completion marker first: a missing, truncated or corrupt file raises
    CheckpointError naming it, before anything is loaded. comm: every rank of it loads this checkpoint now, and
    they share out the checking of ZeRO's optimizer shards (`check_loadable`); without it this rank checks them
    all. The RNG state is returned, not applied: restore it with `set_rng_state` right before training goes on.
    """
    check_loadable(path, optimizer=optimizer is not None, scheduler=scheduler is not None, comm=comm)
    step = folder_step(path)
    device = world.device if world is not None else torch.device("cpu")
    rank = world.rank if world is not None else 0
    if model is not None:
        try:
            load_weights_file(model, os.path.join(path, MODEL_FILE), device=str(device))
        except RuntimeError as exc:  # missing, unexpected or differently shaped weights
            found = str(exc).strip().rstrip(".")[:800]
            raise ValueError(f"{path} holds the weights of another model than this {type(model).__name__}: "
                             f"{found}. Resume with the model the checkpoint was written for, or point "
                             "resume_from_checkpoint at a checkpoint of this model") from exc
    if optimizer is not None and (is_sharded(optimizer) or shard_files(path)):
        try:  # ZeRO's files, or a whole state read by a sharded optimizer: only this rank's ranges
            read_into(path, optimizer, os.path.join(path, OPTIMIZER_FILE))
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise CheckpointError(f"the optimizer state in {path} cannot be loaded: {exc}") from exc
    elif optimizer is not None:
        # Read onto the CPU: the optimizer's load_state_dict moves each state to its parameter's device itself,
        # but leaves Adam's `step` where it was read (on a GPU it would cost host syncs at every step).
        _load_into(optimizer, os.path.join(path, OPTIMIZER_FILE), "cpu")
    if scheduler is not None:
        _load_into(scheduler, os.path.join(path, SCHEDULER_FILE), "cpu")
    if scaler is not None and os.path.isfile(os.path.join(path, SCALER_FILE)):  # none: saved without fp16
        _load_into(scaler, os.path.join(path, SCALER_FILE), "cpu")
    trainer_state = read_trainer_state(path)
    sampler_state = read_sampler_state(path)
    rng_file = os.path.join(path, RNG_FILE.format(rank=rank))
    if rank == 0 and not os.path.isfile(rng_file):
        rng_file = os.path.join(path, SINGLE_RNG_FILE)  # a Transformers Trainer's of one process
    rng = None
    if os.path.isfile(rng_file):
        try:
            with numpy_allowed():
                rng = _load_tensors(rng_file, "cpu")
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"{rng_file} cannot be read: {type(exc).__name__}: {exc}") from exc
    saved_world = len([n for n in os.listdir(path) if re.match(r"^rng_state_\d+\.pth$", n)]) or \
        int(os.path.isfile(os.path.join(path, SINGLE_RNG_FILE)))
    return LoadedCheckpoint(path, step, trainer_state, sampler_state, rng, saved_world)


__all__ = ["LoadedCheckpoint", "check_loadable", "folder_step", "load_checkpoint", "read_sampler_state",
           "read_trainer_state", "save_checkpoint", "save_weights", "write_json"]
