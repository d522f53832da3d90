"""Classify scikit-learn's bundled 8x8 digits with ddpkit's Trainer: the smallest real data-parallel run.

    torchrun --nproc_per_node=2 examples/train_digits.py                        # 2 CPU processes, about 10 s
    python examples/train_digits.py                                             # the same on one process
    torchrun --nproc_per_node=2 examples/train_digits.py --resume_from_checkpoint true   # continue the last run
    python examples/train_digits.py --help                                      # every TrainingArguments flag

Writes to --output_dir (default digits_output): checkpoint-<step>/, metrics.jsonl, trainer_state.json,
loss_curve.png and the final model.safetensors. Prints the evaluation accuracy (>= 95% expected).
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ddpkit import ArgumentParser, TrainingArguments, destroy_process_group
from ddpkit.trainer.trainer import Trainer, set_seed

# This script's defaults where TrainingArguments' (made for fine-tuning large models) do not fit a 64-pixel MLP.
DEFAULTS = dict(output_dir="digits_output", per_device_train_batch_size=32, per_device_eval_batch_size=128,
                learning_rate=2e-3, weight_decay=0.01, num_train_epochs=30, warmup_ratio=0.05, logging_steps=10,
                eval_strategy="epoch", save_strategy="epoch", save_total_limit=2, ddp_find_unused_parameters=False)


class DigitsMLP(nn.Module):
    def __init__(self, hidden: int = 256, classes: int = 10):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.GELU(), nn.Dropout(0.1), nn.Linear(hidden, hidden),
                                 nn.GELU(), nn.Linear(hidden, classes))

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.net(pixel_values)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


def load_digits(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """80% / 20% split of the 1,797 digits, pixels scaled from 0..16 to 0..1."""
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    data = sklearn_digits()
    x_train, x_test, y_train, y_test = train_test_split(data.data / 16.0, data.target, test_size=0.2,
                                                        random_state=seed, stratify=data.target)

    def rows(x: np.ndarray, y: np.ndarray) -> list[dict]:
        return [{"pixel_values": torch.tensor(a, dtype=torch.float32), "labels": torch.tensor(int(b))}
                for a, b in zip(x, y)]

    return rows(x_train, y_train), rows(x_test, y_test)


def accuracy(pred) -> dict[str, float]:
    return {"accuracy": float((pred.predictions.argmax(-1) == pred.label_ids).mean())}


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = ArgumentParser(TrainingArguments, description=__doc__.split("\n")[0])
    parser.set_defaults(**DEFAULTS)
    (args,) = parser.parse_args_into_dataclasses(argv)
    set_seed(args.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    train, test = load_digits()
    trainer = Trainer(DigitsMLP(), args, train_dataset=train, eval_dataset=test, compute_metrics=accuracy)
    result = trainer.train()
    if trainer.state.should_stop:  # SIGTERM or Ctrl-C: the checkpoint is written; this is not a finished run
        if trainer.world.is_main:
            print(f"stopped at step {result.global_step} of {trainer.state.max_steps}; continue with "
                  f"--resume_from_checkpoint true --output_dir {args.output_dir}")
        destroy_process_group()
        return result.metrics
    # The last step was evaluated already unless the flags turned evaluation off: evaluating again repeats it.
    metrics = trainer.state.evaluation_at(result.global_step) or trainer.evaluate()
    trainer.save_model()
    if trainer.world.is_main:
        print(f"{trainer.world.world_size} process(es), {result.global_step} steps in "
              f"{result.metrics['train_runtime']:.1f} s: eval accuracy {metrics['eval_accuracy']:.4f}, "
              f"eval loss {metrics['eval_loss']:.4f}; wrote {args.output_dir}/")
    destroy_process_group()
    return metrics


if __name__ == "__main__":
    main(sys.argv[1:])
