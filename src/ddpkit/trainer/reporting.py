"""Reporting a run: rank 0's log entries into metrics.jsonl and TensorBoard, the progress bar, the loss curve.

    reporter = Reporter(output_dir, reporters=["tensorboard"], is_main=world.is_main)
    reporter.open(state.log_history)                 # metrics.jsonl as the run's log so far; TensorBoard's writer
    reporter.write(entry)                            # one log_history entry (with "step" and "epoch")
    bar = reporter.progress_bar(total=100, initial=0, disabled=False)
    reporter.close(log_history)                      # loss_curve.png (with matplotlib); TensorBoard flushed

Only rank 0 writes anything; on other ranks every call is a no-op, so the Trainer calls them on every rank.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
import time
import warnings
from typing import Any

from ddpkit._utils.atomic import replacing
from ddpkit.distributed.terminal import console_columns

METRICS_FILE = "metrics.jsonl"
LOSS_CURVE_FILE = "loss_curve.png"


class Reporter:
    """Where rank 0's log entries go: metrics.jsonl, TensorBoard when report_to asks for it, the loss curve."""

    def __init__(self, output_dir: str, reporters: list[str], is_main: bool):
        self.output_dir = output_dir
        self.reporters = reporters
        self.is_main = is_main
        self._tb_writer = None
        self._bar: _NoBar | _TerminalBar | _LineBar = _NoBar()

    def open(self, log_history: list[dict[str, Any]] | None = None, continues: bool = False) -> None:
        """Start metrics.jsonl as the run's log so far (`log_history`: a resumed checkpoint's, or none;
        `continues`: this launch takes up the run that file may be the log of, not a branch off an older point
        of it), and the integrations report_to asks for (a missing one warns: metrics.jsonl still gets it all)."""
        if not self.is_main:
            return
        if log_history is not None:
            self._start_metrics(log_history, continues)
        if "tensorboard" not in self.reporters or self._tb_writer is not None:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            warnings.warn("report_to asks for tensorboard, which is not installed (pip install tensorboard); "
                          "logging to metrics.jsonl only", RuntimeWarning, stacklevel=3)
            return
        self._tb_writer = SummaryWriter(log_dir=os.path.join(self.output_dir, "runs"))

    def _start_metrics(self, history: list[dict[str, Any]], continues: bool) -> None:
        """metrics.jsonl holds exactly `history` from now on, so that a resumed run's file reads as the
        uninterrupted run's. A file there that begins with `history`, of the run this launch continues, was this
        run's: its lines past the checkpoint are the steps the resume trains again (bitwise the same losses) and
        go. Any other (an earlier run's, a fresh start's predecessor, the run a branch leaves) is kept, renamed
        metrics.jsonl.<n>."""
        path = os.path.join(self.output_dir, METRICS_FILE)
        old = _read_entries(path)
        if old is None and not history:
            return
        if old and not (continues and history and old[:len(history)] == history):
            aside = next(f"{path}.{n}" for n in itertools.count(1) if not os.path.exists(f"{path}.{n}"))
            os.replace(path, aside)
        os.makedirs(self.output_dir, exist_ok=True)
        with replacing(path, durable=True) as f:
            f.writelines(json.dumps(entry) + "\n" for entry in history)

    def write(self, entry: dict[str, Any]) -> None:
        """One log entry (the Transformers log_history format: the values, "epoch" and "step")."""
        if not self.is_main:
            return
        os.makedirs(self.output_dir, exist_ok=True)
        with open(os.path.join(self.output_dir, METRICS_FILE), "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
        if any(key.startswith("eval_") for key in entry):
            self._bar.write(evaluation_line(entry))
        if self._tb_writer is not None:
            step = entry["step"]
            for key, value in entry.items():
                if key not in ("epoch", "step") and isinstance(value, (int, float)):
                    self._tb_writer.add_scalar(key if key.startswith("eval_") else f"train/{key}", value, step)

    def progress_bar(self, total: int, initial: int, disabled: bool):
        """The bar of a train() call, on stderr: redrawn in place where that reaches a terminal (directly, or
        through `ddpkit launch`), else one line per logging step; an inert one when disabled or off rank 0."""
        if disabled or not self.is_main:
            self._bar = _NoBar()
        else:
            columns = console_columns(sys.stderr)
            self._bar = _TerminalBar(total, initial, columns) if columns else _LineBar(total, initial)
        return self._bar

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

    def show(self, last_loss: float, logged: bool) -> None:
        """One more step on the bar; `logged`: this step was a logging step."""
        shown = "-" if math.isnan(last_loss) else f"{last_loss:.4f}"  # nothing logged yet
        self.bar.step(f"loss={shown} samples/s={self.clock.rate():.0f}", logged)

    def summary(self, train_loss: float) -> dict[str, float]:
        """The final log entry of a run (the Transformers names), its speed rounded as Transformers' speed_metrics
        rounds it: the runtime to 4 decimals, the rates (from the unrounded runtime) to 3."""
        return {"train_runtime": round(self.clock.elapsed(), 4),
                "train_samples_per_second": round(self.clock.rate(), 3),
                "train_steps_per_second": round(self.clock.steps_rate(), 3), "train_loss": train_loss,
                "total_flos": 0.0}


def _read_entries(path: str) -> list[dict[str, Any]] | None:
    """metrics.jsonl's entries (None: no file; a line cut short by a kill ends them)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return None
    entries = []
    for line in lines:
        try:
            entries.append(json.loads(line))
        except ValueError:
            break
    return entries


def evaluation_line(entry: dict[str, Any]) -> str:
    """The console line of one evaluation: step, epoch and every metric."""
    metrics = "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in entry.items()
                        if k.startswith("eval_"))
    return f"eval  step {entry['step']}  epoch {entry['epoch']:.2f}  {metrics}"


class _NoBar:
    """No bar (disabled, or not rank 0); evaluation lines still reach the console."""

    def step(self, postfix: str, logged: bool) -> None: ...

    def write(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    def close(self) -> None: ...


class _TerminalBar:
    """tqdm, redrawn in place: on this process's terminal, or on the one `ddpkit launch` forwards to."""

    def __init__(self, total: int, initial: int, columns: int):
        from tqdm.auto import tqdm

        # Forwarded by the launcher, stderr is a file that cannot say its width: the launcher's is given.
        self._tqdm = tqdm(total=total, initial=initial, desc="train", unit="step", ncols=columns, file=sys.stderr)

    def step(self, postfix: str, logged: bool) -> None:
        self._tqdm.set_postfix_str(postfix, refresh=False)
        self._tqdm.update(1)

    def write(self, line: str) -> None:
        self._tqdm.write(line, file=sys.stderr)  # above the bar, which is redrawn below it

    def close(self) -> None:
        self._tqdm.close()


class _LineBar:
    """Into a pipe or a log file: one line per logging step, never one per update."""

    def __init__(self, total: int, initial: int):
        self.total, self.n, self.start_n = total, initial, initial
        self.start = time.perf_counter()

    def step(self, postfix: str, logged: bool) -> None:
        self.n += 1
        if not logged:
            return
        elapsed = time.perf_counter() - self.start
        left = elapsed / max(1, self.n - self.start_n) * (self.total - self.n)
        percent = 100 * self.n / max(1, self.total)
        self.write(f"train {self.n}/{self.total} [{percent:3.0f}%] {_clock(elapsed)}<{_clock(left)} {postfix}")

    def write(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    def close(self) -> None: ...


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}" if minutes >= 60 else f"{minutes:02d}:{secs:02d}"


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
