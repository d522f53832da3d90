"""Reporting a run: rank 0's log entries into metrics.jsonl and TensorBoard, the progress bar, the loss curve.

    reporter = Reporter(output_dir, reporters=["tensorboard"], is_main=world.is_main)
    reporter.open()                                  # TensorBoard's writer, when asked for and installed
    reporter.write(entry)                            # one log_history entry (with "step" and "epoch")
    bar = reporter.progress_bar(total=100, initial=0, disabled=False)
    reporter.close(log_history)                      # loss_curve.png (with matplotlib); TensorBoard flushed

Only rank 0 writes anything; on other ranks every call is a no-op, so the Trainer calls them on every rank.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from typing import Any

import torch

METRICS_FILE = "metrics.jsonl"
LOSS_CURVE_FILE = "loss_curve.png"


class Reporter:
    """Where rank 0's log entries go: metrics.jsonl, TensorBoard when report_to asks for it, the loss curve."""

    def __init__(self, output_dir: str, reporters: list[str], is_main: bool):
        self.output_dir = output_dir
        self.reporters = reporters
        self.is_main = is_main
        self._tb_writer = None

    def open(self) -> None:
        """Start the integrations report_to asks for (a missing one warns: metrics.jsonl still gets it all)."""
        if not self.is_main or "tensorboard" not in self.reporters or self._tb_writer is not None:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            warnings.warn("report_to asks for tensorboard, which is not installed (pip install tensorboard); "
                          "logging to metrics.jsonl only", RuntimeWarning, stacklevel=3)
            return
        self._tb_writer = SummaryWriter(log_dir=os.path.join(self.output_dir, "runs"))

    def write(self, entry: dict[str, Any]) -> None:
        """One log entry (the Transformers log_history format: the values, "epoch" and "step")."""
        if not self.is_main:
            return
        os.makedirs(self.output_dir, exist_ok=True)
        with open(os.path.join(self.output_dir, METRICS_FILE), "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
        if self._tb_writer is not None:
            step = entry["step"]
            for key, value in entry.items():
                if key not in ("epoch", "step") and isinstance(value, (int, float)):
                    self._tb_writer.add_scalar(key if key.startswith("eval_") else f"train/{key}", value, step)

    def progress_bar(self, total: int, initial: int, disabled: bool):
        """The bar of a train() call (an inert one when disabled or off rank 0)."""
        if disabled or not self.is_main:
            return _NoBar()
        from tqdm.auto import tqdm

        return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)

    def close(self, log_history: list[dict[str, Any]]) -> None:
        """Flush TensorBoard and draw the loss curve of the run."""
        if self._tb_writer is not None:
            self._tb_writer.close()
            self._tb_writer = None
        if self.is_main:
            if any("loss" in e for e in log_history):
                write_loss_curve(os.path.join(self.output_dir, LOSS_CURVE_FILE), log_history)


class Progress:
    """The running figures of one train() call: the clock and the bar (the loss is RunningLoss's)."""

    def __init__(self, bar):
        self.clock = Clock()
        self.bar = bar

    def step(self, samples: int) -> None:
        self.clock.tick(samples)

    def show(self, last_loss: float) -> None:
        shown = "-" if math.isnan(last_loss) else f"{last_loss:.4f}"  # nothing logged yet
        self.bar.set_postfix_str(f"loss={shown} samples/s={self.clock.rate():.0f}", refresh=False)
        self.bar.update(1)

    def summary(self, train_loss: float) -> dict[str, float]:
        """The final log entry of a run (the Transformers names)."""
        return {"train_runtime": self.clock.elapsed(), "train_samples_per_second": self.clock.rate(),
                "train_steps_per_second": self.clock.steps_rate(), "train_loss": train_loss,
                "total_flos": 0.0}


class _NoBar:
    def set_postfix(self, *a, **k): ...
    def set_postfix_str(self, *a, **k): ...
    def update(self, *a, **k): ...
    def close(self): ...


class Clock:
    """Global samples per second: over the whole run (rate) and since the last lap."""

    def __init__(self):
        self.start = self.mark = time.perf_counter()
        self.total = self.since_mark = self.steps = 0

    def tick(self, samples: int) -> None:
        self.total += samples
        self.since_mark += samples
        self.steps += 1

    def rate(self) -> float:
        return self.total / max(self.elapsed(), 1e-9)

    def lap(self) -> float:
        now = time.perf_counter()
        rate = self.since_mark / max(now - self.mark, 1e-9)
        self.mark, self.since_mark = now, 0
        return rate

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def steps_rate(self) -> float:
        return self.steps / max(self.elapsed(), 1e-9)


# -- the loss curve -------------------------------------------------------------------------------------------------
# Log entries that are bookkeeping, not a quantity to plot against the step.
_NOT_PLOTTED = ("epoch", "step", "grad_norm", "samples_per_second")
_NOT_PLOTTED_SUFFIXES = ("_runtime", "_samples_per_second", "_steps_per_second")
MATPLOTLIB_MISSING = (f"ddpkit: {LOSS_CURVE_FILE} not drawn: it needs matplotlib "
                      "(pip install 'ddpkit[examples]', or pip install matplotlib)")


def curves(log_history: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """(step, value) series of the log: "loss", "learning_rate", "eval_loss" and every evaluation metric."""
    found: dict[str, list[tuple[int, float]]] = {}
    for entry in log_history:
        if "train_runtime" in entry:
            continue  # the final summary: its train_loss is the run's mean, not a point of the curve
        for key, value in entry.items():
            if (key in _NOT_PLOTTED or key.endswith(_NOT_PLOTTED_SUFFIXES) or isinstance(value, bool)
                    or not isinstance(value, (int, float)) or not math.isfinite(value)):
                continue
            found.setdefault(key, []).append((int(entry["step"]), float(value)))
    return found


def loss_curve_figure(log_history: list[dict[str, Any]]):
    """A matplotlib Figure against the optimizer step: the training and evaluation loss; the evaluation metrics
    (when there are any); the learning rate. Raises ImportError without matplotlib."""
    from matplotlib.figure import Figure

    series = curves(log_history)
    metrics = sorted(k for k in series if k.startswith("eval_") and k != "eval_loss")
    panels = [("loss", [("loss", "training loss", "-"), ("eval_loss", "evaluation loss", "o-")])]
    if metrics:
        panels.append(("evaluation metric", [(k, k.removeprefix("eval_"), "s-") for k in metrics]))
    panels.append(("learning rate", [("learning_rate", "learning rate", "-")]))
    fig = Figure(figsize=(8, 2.2 + 2.2 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (ylabel, lines) in zip(axes, panels):
        for key, label, style in lines:
            if key in series:
                ax.plot(*zip(*series[key]), style, label=label, markersize=4)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best")
    axes[0].set_title("training run by optimizer step")
    axes[-1].set_xlabel("step")
    return fig


def write_loss_curve(path: str, log_history: list[dict[str, Any]]) -> bool:
    """Draw `loss_curve_figure` into `path` (a PNG); without matplotlib, one line says how to get it (False)."""
    try:
        fig = loss_curve_figure(log_history)
    except ImportError:
        print(MATPLOTLIB_MISSING, file=sys.stderr, flush=True)
        return False
    fig.savefig(path, dpi=100)
    return True


__all__ = ["LOSS_CURVE_FILE", "METRICS_FILE", "Clock", "Progress", "Reporter", "curves", "loss_curve_figure",
           "write_loss_curve"]
