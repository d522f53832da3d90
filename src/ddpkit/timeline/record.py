"""The recording API the engine and the Trainer call, and the names of the phases they record.

    recorder = NULL_RECORDER                        # no timeline: every call below does (almost) nothing
    with recorder.span(DATA_WAIT, "data"):          # a phase of the main thread
        batch = next(batches)
    began = recorder.begin()                        # a phase whose start and end are in different functions
    recorder.end(BACKWARD, "backward", began)
    if recorder.active:                             # the one test hot paths pay (once per parameter at most)
        recorder.instant(BUCKET_READY, "bucket", {"bucket": 3})

A `ddpkit.timeline.recorder.Timeline` is the recorder that records; it has these methods too. Spans also enter
`torch.profiler.record_function` under the same name while a torch profiler runs, so a torch trace of the same run
shows the same phases; without a profiler they skip it (entering one costs tens of microseconds on a busy CPU).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

# Phase names: the timeline's, and record_function's where a span enters one.
FORWARD = "DistributedDataParallel.forward"  # torch's DDP uses this name for its forward too
BACKWARD = "DistributedDataParallel.backward"  # first autograd node to the end of the reducer's finalize
FIRST_GRAD = "first gradient ready"  # instant: the first parameter of a bucket got its gradient
BUCKET_READY = "bucket ready"  # instant: every parameter of a bucket got its gradient
DATA_WAIT = "data wait"  # the main thread blocked on the data loader
EVALUATION = "evaluation"
CHECKPOINT = "checkpoint save"


def copy_in(bucket: int) -> str:
    """The span of a bucket's launch: its gradients copied into the flat buffer, divided, handed to the backend."""
    return f"copy in bucket {bucket}"


def optimizer_step(optimizer: Any) -> str:
    """torch's own record_function name for an optimizer's step, so both traces say the same."""
    return f"Optimizer.step#{type(optimizer).__name__}.step"


_NOTHING = contextlib.nullcontext()


def profiled(name: str) -> contextlib.AbstractContextManager:
    """record_function(name) while a torch profiler runs, else a shared no-op context."""
    if torch.autograd._profiler_enabled():
        return torch.autograd.profiler.record_function(name)
    return _NOTHING


class NullRecorder:
    """The recorder when no timeline is recording: nothing is kept."""

    active = False

    def span(self, name: str, cat: str = "compute", args: dict | None = None) -> contextlib.AbstractContextManager:
        return profiled(name)

    def timed(self, name: str, cat: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs), recorded as a span."""
        with self.span(name, cat):
            return fn(*args, **kwargs)

    def begin(self) -> float | None:
        return None

    def end(self, name: str, cat: str, began: float | None, args: dict | None = None) -> None:
        pass

    def instant(self, name: str, cat: str, args: dict | None = None) -> None:
        pass

    def flush(self) -> None:
        pass


NULL_RECORDER = NullRecorder()
