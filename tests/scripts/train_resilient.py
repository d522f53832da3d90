"""A small Trainer job on synthetic data that can be stopped, crashed and resumed, for the resilience tests.

    ddpkit launch --nproc-per-node 2 tests/scripts/train_resilient.py --output_dir /tmp/r      # 24 steps
    # slow enough to signal: SIGTERM to the launcher, and every rank stops after the same step, rank 0 writes
    # one checkpoint, the workers exit 0; then finish the run from that checkpoint
    ddpkit launch --nproc-per-node 2 tests/scripts/train_resilient.py --output_dir /tmp/r --sleep_per_step 0.5
    ddpkit launch --nproc-per-node 2 tests/scripts/train_resilient.py --output_dir /tmp/r --resume_from_checkpoint true
    # rank 1 raises at step 7 on the first attempt; the restarted workers resume from checkpoint-6 on their own
    ddpkit launch --nproc-per-node 2 --max-restarts 1 tests/scripts/train_resilient.py --output_dir /tmp/r \
        --save_strategy steps --save_steps 3 --crash_at_step 7

Takes every TrainingArguments flag plus the few of ScriptArguments below. The data (a random linear teacher's
labels for Gaussian inputs) is made here from a fixed seed, so every run and every rank sees the same set. Prints,
on every rank:
    LOGGED step <N>                 each time the Trainer logs (the tests wait for the first one)
    RESULT {"rank", "restart", "resumed_at", "global_step", "stopped", "params_sha256"}   last, before exiting
resumed_at is the global step the first optimizer step of this process started from (0 on a fresh run).
"""

from __future__ import annotations

import ctypes
import os
import signal


def die_with_parent() -> None:
    """Test hygiene: if the launcher is SIGKILLed, take this worker down too (Linux only).

    Called before the slow imports below, so that no worker outlives a killed launcher while importing torch.
    KEEP_ORPHANS=1 leaves it out, for the test of ddpkit's own watch (which must not lean on this one).
    """
    if os.environ.get("KEEP_ORPHANS") == "1":
        return
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


die_with_parent()

import dataclasses
import hashlib
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import ddpkit
from ddpkit import ArgumentParser, Trainer, TrainingArguments

FEATURES, CLASSES = 16, 4
# This script's defaults where TrainingArguments' do not fit a 16-feature MLP trained for a few seconds.
DEFAULTS = {"per_device_train_batch_size": 8, "learning_rate": 1e-2, "max_steps": 24, "logging_steps": 1,
            "save_strategy": "no", "disable_tqdm": True, "ddp_timeout": 60, "seed": 0}


@dataclasses.dataclass
class ScriptArguments:
    samples: int = dataclasses.field(default=96, metadata={"help": "Training samples (the whole set, all ranks)."})
    crash_at_step: int = dataclasses.field(default=0, metadata={
        "help": "Rank 1 raises at this global step (1-based), on the launcher's first attempt only; 0: never."})
    sleep_per_step: float = dataclasses.field(default=0.0, metadata={
        "help": "Seconds to sleep before each optimizer step, to leave time to signal the job."})


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        # Dropout: resuming must restore every rank's RNG too, or the bitwise comparison fails.
        self.net = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, CLASSES))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def make_data(samples: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)  # its own generator: the same set whatever the global seed
    x = torch.randn(samples, FEATURES, generator=gen)
    labels = (x @ torch.randn(FEATURES, CLASSES, generator=gen)).argmax(-1)
    return [{"x": x[i], "labels": labels[i]} for i in range(samples)]


class ResilientTrainer(Trainer):
    """The Trainer with the script's faults and traces: a crash, a slow step, a line per log."""

    def __init__(self, *a, script: ScriptArguments, **kw):
        super().__init__(*a, **kw)
        self.script = script
        self.resumed_at: int | None = None

    def training_step(self, model, inputs, num_items_in_batch=None):
        step = self.state.global_step + 1  # the step about to be taken (global_step counts finished ones)
        if self.resumed_at is None:
            self.resumed_at = self.state.global_step
        if self.script.crash_at_step == step and self.world.rank == 1 and self.world.restart == 0:
            print(f"CRASH rank 1 at step {step}", flush=True)
            raise RuntimeError(f"rank 1 crashes on purpose at step {step}")
        if self.script.sleep_per_step:
            time.sleep(self.script.sleep_per_step)
        return super().training_step(model, inputs, num_items_in_batch)

    def log(self, logs):
        super().log(logs)
        if "loss" in logs:
            print(f"LOGGED step {self.state.global_step}", flush=True)


def params_sha256(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main(argv: list[str]) -> None:
    parser = ArgumentParser((TrainingArguments, ScriptArguments), description=__doc__.split("\n")[0])
    parser.set_defaults(**DEFAULTS)
    args, script = parser.parse_args_into_dataclasses(argv)
    ddpkit.set_seed(args.seed)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    trainer = ResilientTrainer(MLP(), args, train_dataset=make_data(script.samples), script=script)
    out = trainer.train()
    result = {"rank": trainer.world.rank, "restart": trainer.world.restart, "resumed_at": trainer.resumed_at,
              "global_step": out.global_step, "stopped": trainer.state.should_stop,
              "params_sha256": params_sha256(trainer.model)}
    ddpkit.destroy_process_group()
    print("RESULT " + json.dumps(result), flush=True)  # the last thing the script does: it exits 0 after it


if __name__ == "__main__":
    main(sys.argv[1:])
