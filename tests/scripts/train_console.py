"""A Trainer job whose console the tests read: rank 0's progress bar, evaluations, and lines from rank 1.

    ddpkit launch --nproc-per-node 2 tests/scripts/train_console.py --output_dir /tmp/c     # 12 steps
    python tests/scripts/train_console.py --output_dir /tmp/c                                # one process

Every TrainingArguments flag, plus --crash_at_step N (rank 1 raises at that step; 0: never). Rank 1 prints
"rank 1 took step <N>" after every step, so that other ranks' lines must print above rank 0's bar.
"""

from __future__ import annotations

import ctypes
import dataclasses
import signal
import sys
import time

try:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with a SIGKILLed launcher (tests' hygiene)
except (OSError, AttributeError):
    pass

import torch
import torch.nn.functional as F
from torch import nn

import ddpkit
from ddpkit import ArgumentParser, Trainer, TrainingArguments

DEFAULTS = {"per_device_train_batch_size": 4, "learning_rate": 1e-2, "max_steps": 12, "logging_steps": 3,
            "eval_strategy": "steps", "eval_steps": 6, "save_strategy": "no", "ddp_timeout": 60, "seed": 0}


@dataclasses.dataclass
class ScriptArguments:
    crash_at_step: int = dataclasses.field(default=0, metadata={"help": "Rank 1 raises at this step; 0: never."})
    seconds_per_step: float = dataclasses.field(default=0.15, metadata={"help": "Sleep per step (bar redraws)."})


class Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 3)

    def forward(self, x, labels):
        logits = self.net(x)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


class ConsoleTrainer(Trainer):
    def __init__(self, *a, script: ScriptArguments, **kw):
        super().__init__(*a, **kw)
        self.script = script

    def training_step(self, model, inputs, num_items_in_batch=None):
        step = self.state.global_step + 1
        if self.world.rank == 1 and step == self.script.crash_at_step:
            raise RuntimeError(f"rank 1 crashes on purpose at step {step}")
        time.sleep(self.script.seconds_per_step)
        out = super().training_step(model, inputs, num_items_in_batch)
        if self.world.rank == 1:
            print(f"rank 1 took step {step}", flush=True)
        return out


def accuracy(pred):
    return {"accuracy": float((pred.predictions.argmax(-1) == pred.label_ids).mean())}


def main(argv):
    parser = ArgumentParser((TrainingArguments, ScriptArguments))
    parser.set_defaults(**DEFAULTS)
    args, script = parser.parse_args_into_dataclasses(argv)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=gen)
    data = [{"x": x[i], "labels": (x[i, 0] > 0).long() + (x[i, 1] > 0).long()} for i in range(96)]
    trainer = ConsoleTrainer(Linear(), args, train_dataset=data, eval_dataset=data[:24], compute_metrics=accuracy,
                             script=script)
    trainer.train()
    ddpkit.destroy_process_group()
    print("DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
