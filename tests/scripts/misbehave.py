"""A small Trainer job that deadlocks or loses a rank on purpose, for the stall inspector's tests. Every ddpkit
setting is left at its default (ddp_timeout 1800 s, the inspector's default threshold).

    # rank 0 alone evaluates after training, then every rank saves: rank 0 waits in the evaluation's
    # all-reduce, rank 1 in save_model's barrier; the job must end within seconds with ORDER MISMATCH
    ddpkit launch --nproc-per-node 2 tests/scripts/misbehave.py --mode eval_on_rank0 --output_dir /tmp/m
    # rank 1 returns from its training step's loop and exits 0 at step 3 while rank 0 trains on
    ddpkit launch --nproc-per-node 2 tests/scripts/misbehave.py --mode leave_early --output_dir /tmp/m
    # the same through os._exit(0): no exit handler runs, so rank 1 never says that it left
    ddpkit launch --nproc-per-node 2 tests/scripts/misbehave.py --mode vanish --output_dir /tmp/m

Prints `ENTER <rank> <unix time>` just before a rank calls what will deadlock (eval_on_rank0), and
`LEAVING <rank> <unix time>` before rank 1 exits (leave_early, vanish).
"""

from __future__ import annotations

import ctypes
import signal

try:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: test hygiene, die with the launcher
except (OSError, AttributeError):
    pass

import dataclasses
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import ddpkit
from ddpkit import ArgumentParser, Trainer, TrainingArguments

FEATURES, CLASSES = 8, 3


@dataclasses.dataclass
class ScriptArguments:
    mode: str = dataclasses.field(default="eval_on_rank0", metadata={"help": "eval_on_rank0, leave_early or vanish."})
    leave_at_step: int = dataclasses.field(default=3, metadata={"help": "leave_early: rank 1 exits 0 here."})


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def make_data(samples: int = 64) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(samples, FEATURES, generator=gen)
    labels = (x @ torch.randn(FEATURES, CLASSES, generator=gen)).argmax(-1)
    return [{"x": x[i], "labels": labels[i]} for i in range(samples)]


class LeavingTrainer(Trainer):
    def __init__(self, *a, leave_at_step: int, vanish: bool = False, **kw):
        super().__init__(*a, **kw)
        self.leave_at_step, self.vanish = leave_at_step, vanish

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.world.rank == 1 and self.state.global_step + 1 == self.leave_at_step:
            print(f"LEAVING 1 {time.time():.3f}", flush=True)
            if self.vanish:
                time.sleep(1.5)  # long enough for its stall inspector to have published where it is
                os._exit(0)  # no exit handler runs: nothing tells the others that it left
            sys.exit(0)  # a clean exit in the middle of training: no error, exit code 0
        return super().training_step(model, inputs, num_items_in_batch)


def main(argv: list[str]) -> None:
    parser = ArgumentParser((TrainingArguments, ScriptArguments), description=__doc__.split("\n")[0])
    parser.set_defaults(per_device_train_batch_size=8, max_steps=6, logging_steps=2, save_strategy="no",
                        disable_tqdm=True, seed=0, report_to="none")
    args, script = parser.parse_args_into_dataclasses(argv)
    data = make_data()
    trainer = LeavingTrainer(MLP(), args, train_dataset=data, eval_dataset=data,
                             leave_at_step=script.leave_at_step if script.mode in ("leave_early", "vanish") else 0,
                             vanish=script.mode == "vanish")
    trainer.train()
    rank = trainer.world.rank
    print(f"ENTER {rank} {time.time():.3f}", flush=True)
    if script.mode == "eval_on_rank0" and rank == 0:
        trainer.evaluate()  # the bug: a collective on rank 0 only
    trainer.predict(data)  # what every rank calls next: rank 1 comes here while rank 0 evaluates
    print(f"FINISHED {rank}", flush=True)
    ddpkit.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
