"""Reporting a run: rank 0's log entries into metrics.jsonl and TensorBoard, the progress bar, the loss curve.

    reporter = Reporter(output_dir, reporters=["tensorboard"], is_main=world.is_main)
    reporter.open()                                  # TensorBoard's writer, when asked for and installed
    reporter.write(entry)                            # one log_history entry (with "step" and "epoch")
    bar = reporter.progress_bar(total=100, initial=0, disabled=False)
    reporter.close(log_history)                      # the loss curve; TensorBoard's files flushed

Only rank 0 writes anything; on other ranks every call is a no-op, so the Trainer calls them on every rank.
"""

from __future__ import annotations

import json
import math
import os
import struct
import time
import warnings
import zlib
from typing import Any

import numpy as np
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
            points = [(e["step"], e["loss"]) for e in log_history if "loss" in e]
            if points:
                write_loss_curve(os.path.join(self.output_dir, LOSS_CURVE_FILE), points)


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


# -- the loss curve: a PNG without plotting libraries -----------------------------------------------------------------
# matplotlib would add ~50 MB of dependencies for one picture; a line plot needs only zlib and a tiny font.

_GLYPHS = {  # 3x5 pixels, rows top to bottom
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001001001",
    "8": "111101111101111", "9": "111101111001111", ".": "000000000000010", "-": "000000111000000",
    "+": "000010111010000", "e": "000111111100111",
}


def write_png(path: str, pixels: np.ndarray) -> None:
    """An RGB uint8 array (height, width, 3) as a PNG file."""
    height, width, _ = pixels.shape
    raw = b"".join(b"\x00" + pixels[y].tobytes() for y in range(height))  # filter type 0 on every row

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits per channel, truecolour
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9))
                + chunk(b"IEND", b""))


def _text(img: np.ndarray, x: int, y: int, text: str, scale: int = 2) -> None:
    for ch in text:
        glyph = _GLYPHS.get(ch)
        if glyph is not None:
            for i, bit in enumerate(glyph):
                if bit == "1":
                    gy, gx = y + (i // 3) * scale, x + (i % 3) * scale
                    img[max(gy, 0):gy + scale, max(gx, 0):gx + scale] = 0
        x += 4 * scale


def write_loss_curve(path: str, points: list[tuple[int, float]], width: int = 640, height: int = 400) -> None:
    """A line plot of loss against step, with the axis ranges written at the corners."""
    img = np.full((height, width, 3), 255, dtype=np.uint8)
    left, right, top, bottom = 70, width - 20, 20, height - 40
    steps = np.array([p[0] for p in points], dtype=np.float64)
    losses = np.array([p[1] for p in points], dtype=np.float64)
    lo, hi = float(np.nanmin(losses)), float(np.nanmax(losses))
    hi = hi if hi > lo else lo + 1.0
    s0, s1 = float(steps.min()), float(steps.max())
    s1 = s1 if s1 > s0 else s0 + 1.0
    xs = left + (steps - s0) / (s1 - s0) * (right - left)
    ys = bottom - (losses - lo) / (hi - lo) * (bottom - top)
    img[top:bottom + 1, left] = img[bottom, left:right + 1] = (120, 120, 120)  # axes
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for t in np.linspace(0.0, 1.0, n + 1):
            x, y = round(x0 + t * (x1 - x0)), round(y0 + t * (y1 - y0))
            img[max(y - 1, 0):y + 1, max(x - 1, 0):x + 1] = (31, 119, 180)
    if len(xs) == 1:
        img[int(ys[0]) - 2:int(ys[0]) + 3, int(xs[0]) - 2:int(xs[0]) + 3] = (31, 119, 180)
    _text(img, 4, top, f"{hi:.3g}")
    _text(img, 4, bottom - 10, f"{lo:.3g}")
    _text(img, left, bottom + 10, f"{int(s0)}")
    label = f"{int(s1)}"
    _text(img, right - 8 * len(label), bottom + 10, label)
    write_png(path, img)



__all__ = ["LOSS_CURVE_FILE", "METRICS_FILE", "Clock", "Progress", "Reporter", "write_loss_curve", "write_png"]
