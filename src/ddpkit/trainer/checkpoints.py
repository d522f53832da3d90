"""The Trainer's checkpoints of one run: where they go, whether one exists, writing one, the best one.

    saves = Saves(args, comm, world, best=BestModel.for_args(args))
    saves.exists(step)                                   # rank 0's view, on every rank
    folder = saves.save(state, model=..., optimizer=..., scheduler=..., sampler_state=...)
    saves.load_best(model, state)                        # load_best_model_at_end
    saves.write_final_state(state)                       # output_dir/trainer_state.json, Transformers' fields
    saves.save_model(model, output_dir, args.to_dict())  # Trainer.save_model's files, from rank 0 (no collective)

Rotation (save_total_limit) never deletes the checkpoint this run was told to resume from (`keep`, see
resume.protected_checkpoints), the best one (best_model.py), nor another run's (`run`, see ddpkit.checkpoint.run_ids). The files
themselves are checkpoint.py's.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ddpkit._utils import atomic
from ddpkit.checkpoint import files as checkpoint
from ddpkit.checkpoint import folders
from ddpkit.checkpoint import integrity
from ddpkit.distributed.comm import Comm, decided_by_main
from ddpkit.distributed.env import DistEnv
from ddpkit.trainer.best_model import BestModel


class Saves:
    def __init__(self, args: Any, comm: Comm, world: DistEnv, best: BestModel | None = None, processor: Any = None):
        self.args, self.output_dir = args, args.output_dir  # args: training_args.bin's
        self.processor = processor  # what every checkpoint and save_model also save: saved_processor's
        self.save_total_limit = args.save_total_limit
        self.per_device_train_batch_size = args.per_device_train_batch_size  # trainer_state.json's train_batch_size
        self.comm, self.world, self.best = comm, world, best
        self.keep: tuple[str, ...] = ()  # set by the Trainer once it knows what it resumes from
        self.run: str | None = None  # the training run's id (ddpkit.checkpoint.run_ids): in every marker, and what rotation retires
        self._written: set[tuple[str | None, int]] = set()  # (run, step) of the checkpoints save() wrote

    def folder(self, step: int) -> str:
        return os.path.join(self.output_dir, f"{folders.PREFIX}-{step}")

    def start(self, run: str | None) -> None:
        """A train() call begins, as `run`: what an earlier call wrote is no proof of what the disk holds now
        (a resume of the same run may have skipped its checkpoint as corrupt)."""
        self.run, self._written = run, set()

    def exists(self, step: int) -> bool:
        """Whether this run has a whole checkpoint-<step>, as rank 0 sees it: every rank must take the same
        decision, also on nodes that do not share a file system (saving is a collective). Another run's checkpoint
        of that step is none of this run's: a save then renames it aside (ddpkit.checkpoint.files). This run's own, renamed
        aside by another's save, counts (a restarted script's first train() call resumed from it), once its files
        pass their checks: a corrupt one (which a resume skipped, training that step again) is saved anew."""
        if (self.run, step) in self._written:  # written by save() in this process: whole, no need to read it
            return True
        here = self._whole_and_ours(self.own(self.folder(step))) if self.world.is_main else None
        return bool(decided_by_main(self.comm, here, f"checkpoint-{step} exists?"))

    def _whole_and_ours(self, folder: str) -> bool:
        return self._ours(folder) and not integrity.problems(folder)

    def _ours(self, folder: str) -> bool:
        return os.path.isdir(folder) and (self.run is None or folders.checkpoint_run(folder) == self.run)

    def own(self, path: str) -> str:
        """Where this run's checkpoint saved as `path` is now: `path`, or, once a later run's save of the same
        step renamed it aside, ``<path>.run-<this run>``, as this rank's file system shows it (a resumed
        best_model_checkpoint goes through it)."""
        aside = folders.aside_name(path, self.run)
        return aside if self.run is not None and not self._ours(path) and os.path.isdir(aside) else path

    def write_final_state(self, state: Any) -> None:
        """output_dir/trainer_state.json at the end of training, from rank 0: Transformers' half of `state.split`,
        as a checkpoint's (nothing resumes from this one, so ddpkit's half is not written)."""
        if self.world.is_main:
            checkpoint.write_json(os.path.join(self.output_dir, folders.TRAINER_STATE_FILE),
                                  state.split(self.per_device_train_batch_size)[0])

    def save(self, state: Any, *, model: Any, optimizer: Any, scheduler: Any, sampler_state: dict,
             scaler: Any = None, rng: bool = True) -> str:
        """checkpoint-<state.global_step>, with the state's best_model_checkpoint already naming it if it is the
        best; call it on every rank. The state goes into two files (TrainerState.split): trainer_state.json, which
        Transformers loads, and ddpkit_state.json."""
        step = state.global_step
        if self.best is not None:
            self.best.note_save(state, self.folder(step), step)
        theirs, ours = state.split(self.per_device_train_batch_size)
        folder = checkpoint.save_checkpoint(
            self.output_dir, step, model=model, optimizer=optimizer, scheduler=scheduler, trainer_state=theirs,
            ddpkit_state=ours, sampler_state=sampler_state, comm=self.comm, world=self.world,
            save_total_limit=self.save_total_limit, keep=(*self.keep, *BestModel.protected(state)), scaler=scaler,
            run=self.run, rng=rng, processor=self.processor, training_args=self.args)
        self._written.add((self.run, step))
        return folder

    def save_model(self, model: Any, output_dir: str, training_args: dict) -> None:
        """Trainer.save_model: rank 0 writes (save_model below), the other ranks do nothing. No collective, as in
        Transformers' Trainer under DDP: scripts call it on every rank or under `if trainer.is_world_process_zero()`.
        Rank 0's failure raises there, and its exit takes the job down (ddpkit launch, torchrun)."""
        if self.world.is_main:
            save_model(model, output_dir, training_args, self.processor, self.args)

    def load_best(self, model: Any, state: Any) -> str | None:
        """load_best_model_at_end: every rank loads the best checkpoint's weights, so the replicas stay equal."""
        if self.best is None:
            return None
        loaded = self.best.load_at_end(state, lambda path: checkpoint.load_checkpoint(path, model=model,
                                                                                       world=self.world))
        if loaded is not None and self.world.is_main:
            print(f"Loaded the best model from {loaded} ({self.best.key} = {state.best_metric})", flush=True)
        return loaded


def saved_processor(processing_class: Any, data_collator: Any) -> Any:
    """What checkpoints and save_model save beside the model, as Transformers' Trainer: processing_class, else the
    data collator's tokenizer (DataCollatorWithPadding's, say); None: nothing."""
    found = processing_class if processing_class is not None else getattr(data_collator, "tokenizer", None)
    return found if callable(getattr(found, "save_pretrained", None)) else None


def save_model(model: Any, output_dir: str, training_args: dict, processor: Any = None, args: Any = None) -> None:
    """The model, the processor (a tokenizer: saved_processor's), training_args.json and (args, where given)
    Transformers' training_args.bin into output_dir (rank 0's part of Trainer.save_model). A Transformers model is
    saved by its save_pretrained, as Transformers' Trainer saves it: config.json beside the weights, so that
    from_pretrained(output_dir) loads it; any other model as model.safetensors. The processor saves first, as in
    a checkpoint: a name both write (config.json) is the model's."""
    os.makedirs(output_dir, exist_ok=True)
    if processor is not None:
        processor.save_pretrained(output_dir)
    if callable(getattr(model, "save_pretrained", None)):
        model.save_pretrained(output_dir)
    else:
        checkpoint.save_weights(model, os.path.join(output_dir, checkpoint.MODEL_FILE))
    checkpoint.write_json(os.path.join(output_dir, "training_args.json"), training_args)
    if args is not None:
        with atomic.replacing_path(os.path.join(output_dir, checkpoint.TRAINING_ARGS_FILE)) as path:
            torch.save(args, path)


__all__ = ["Saves", "save_model", "saved_processor"]
