"""The timeline: where every rank's step goes, and how much communication hides behind compute.

    ddpkit launch --nproc-per-node 2 --timeline t.json train.py        # steps 3 to 8 (timeline_spec.DEFAULT_STEPS)
    ddpkit launch --nproc-per-node 2 --timeline t.json --timeline-steps 10:20 train.py
    python train.py --ddp_timeline_steps 3:8                           # the Trainer: output_dir/timeline.json
    ddpkit timeline t.json [--png steps.png]                           # the summary again, and a picture of it

A `Timeline` is one more observer of a `ddpkit.Comm` (like the stall inspector; the Comm imports neither) and the
recorder the DDP wrapper, its reducer and the Trainer call (see record.py): it keeps, per rank, with
perf_counter timestamps, every collective (issued, finished, the main thread's waits), forward, backward, each
bucket (first gradient ready, ready, copied in and launched), optimizer steps, data waits, evaluation and
checkpoint saves. A step ends when the first optimizer that steps returns from `step()` (a global optimizer hook),
so any training loop is cut into the same steps as the Trainer's global_step. Only steps A to B are kept; outside
them every call returns at once.

When step B ends (or the process group closes before), every rank posts its events, shifted onto rank 0's clock
(clock.py), to the job's store; rank 0 merges them into one Chrome trace (trace.py), prints the
summary (summary.py) and writes it beside the trace.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.errors import ArgumentError
from ddpkit.timeline import clock as timeline_clock
from ddpkit.timeline import spec as timeline_spec
from ddpkit.timeline import summary as timeline_summary
from ddpkit.timeline import trace as timeline_trace
from ddpkit.timeline.record import (
    CHECKPOINT,
    DATA_WAIT,
    EVALUATION,
    NULL_RECORDER,
    NullRecorder,
    optimizer_step,
    profiled,
)
from ddpkit.timeline.spec import output_path_problem, parse_steps, summary_path

COMPUTE, COMM = timeline_trace.COMPUTE, timeline_trace.COMM
TRACE_FILE = "timeline.json"  # the Trainer's, in output_dir, when ddp_timeline_steps is set
# How long rank 0 waits for the other ranks' events once it has posted its own. Every rank ends step B within
# one collective of the others, so only a rank that died (or never reaches step B) takes this long.
GATHER_TIMEOUT_S = 60.0


class _Span:
    __slots__ = ("timeline", "name", "cat", "args", "began", "profile")

    def __init__(self, timeline: Timeline, name: str, cat: str, args: dict | None):
        self.timeline, self.name, self.cat, self.args = timeline, name, cat, args

    def __enter__(self) -> _Span:
        self.profile = profiled(self.name)
        self.profile.__enter__()
        self.began = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        ended = time.perf_counter()
        self.profile.__exit__(*exc)
        self.timeline.events.append(("X", COMPUTE, self.name, self.cat, self.began, ended, self.args))


class Timeline(NullRecorder):
    """Records this rank's phases and collectives during optimizer steps `steps` = (A, B), both included.

    store/prefix: where the ranks meet to merge (None: write this rank's events alone); clock: this rank's
    (offset, error) to rank 0 in seconds; path: the merged trace rank 0 writes (None: keep the events only).
    """

    def __init__(self, rank: int, world_size: int, steps: tuple[int, int] | None = None, path: str | None = None,
                 store: Any = None, prefix: str = "", clock: tuple[float, float] = (0.0, 0.0),
                 gather_timeout_s: float = GATHER_TIMEOUT_S):
        self.rank, self.world_size = rank, world_size
        self.first, self.last = steps if steps is not None else (1, math.inf)
        self.path, self.store, self.prefix = path, store, prefix
        self.offset, self.clock_error = clock
        self.gather_timeout_s = gather_timeout_s
        self.events: list[tuple] = []  # (ph, track, name, cat, began, ended, args), local perf_counter seconds
        self.step = 1  # the optimizer step in progress
        self.step_began = time.perf_counter()
        self.active = self.first == 1
        self.done = False
        self.summary: dict | None = None  # rank 0's, once written
        self._issued: dict[int, float] = {}  # id(record) -> when it was issued
        self._waits: dict[int, float] = {}
        self._optimizer_began: dict[int, float] = {}
        self._stepper: int | None = None  # id() of the optimizer whose steps are the timeline's
        self._hooks: list[Any] = []

    # -- the recorder (see timeline_record.NullRecorder) ---------------------------------------------------------
    def span(self, name: str, cat: str = "compute", args: dict | None = None):
        return _Span(self, name, cat, args) if self.active else profiled(name)

    def begin(self) -> float | None:
        return time.perf_counter() if self.active else None

    def end(self, name: str, cat: str, began: float | None, args: dict | None = None) -> None:
        if began is not None and self.active:
            self.events.append(("X", COMPUTE, name, cat, began, time.perf_counter(), args))

    def instant(self, name: str, cat: str, args: dict | None = None) -> None:
        if self.active:
            now = time.perf_counter()
            self.events.append(("i", COMPUTE, name, cat, now, now, args))

    # -- the Comm observer (see comm.CommObserver) ---------------------------------------------------------------
    def issued(self, record: Any) -> None:
        if self.active:
            self._issued[id(record)] = time.perf_counter()

    def wait_began(self, record: Any) -> None:
        if self.active:
            self._waits[id(record)] = time.perf_counter()

    def wait_ended(self, record: Any, error: BaseException | None) -> None:
        began = self._waits.pop(id(record), None)
        if began is not None:
            self.events.append(("X", COMPUTE, f"wait {record.op} ({record.what})", "wait", began,
                                time.perf_counter(), {"seq": record.seq}))
        return None

    def finished(self, record: Any, error: BaseException | None) -> None:
        # Possibly from the backend's thread: appending to a list is atomic under the GIL.
        issued = self._issued.pop(id(record), None)
        if issued is not None:
            self.events.append(("X", COMM, f"{record.op} ({record.what})", "collective", issued, time.perf_counter(),
                                {"op": record.op, "what": record.what, "bytes": record.nbytes, "seq": record.seq,
                                 "failed": error is not None}))

    def deferred(self, record: Any, completed: Any) -> None:
        """A wait that returned before its collective completed on the device (NCCL's): not followed here; its
        span ends at `finished`, when it was enqueued."""

    def close(self) -> None:
        self.flush()

    # -- steps -----------------------------------------------------------------------------------------------------
    def watch_optimizers(self) -> None:
        """Cut the run into steps at every optimizer.step (torch's global optimizer hooks), until `flush`."""
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self._hooks = [register_optimizer_step_pre_hook(self._before_optimizer),
                       register_optimizer_step_post_hook(self._after_optimizer)]

    def _before_optimizer(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.active:
            self._optimizer_began[id(optimizer)] = time.perf_counter()

    def _after_optimizer(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        now = time.perf_counter()
        began = self._optimizer_began.pop(id(optimizer), None)
        if began is not None and self.active:
            self.events.append(("X", COMPUTE, optimizer_step(optimizer), "optimizer", began, now, None))
        if self._stepper is None:
            self._stepper = id(optimizer)  # with several optimizers (a GAN's), the first to step counts steps
        if id(optimizer) == self._stepper:
            self.step_done(now)

    def step_done(self, now: float | None = None) -> None:
        """The optimizer step in progress ended (called by the optimizer hook; a loop without one may call it)."""
        now = time.perf_counter() if now is None else now
        if self.active:
            self.events.append(("X", COMPUTE, f"step {self.step}", "step", self.step_began, now,
                                {"step": self.step}))
        self.step += 1
        self.step_began = now
        if self.step > self.last:
            self.flush()
        elif self.step == self.first:
            self.active = True

    # -- the end: merge on rank 0 ------------------------------------------------------------------------------------
    def payload(self) -> dict[str, Any]:
        """This rank's events on rank 0's clock (seconds), as posted to the store."""
        offset = self.offset
        events = [[ph, track, name, cat, began + offset, ended + offset, args]
                  for ph, track, name, cat, began, ended, args in list(self.events)]
        return {"rank": self.rank, "clock_offset_s": offset, "clock_error_s": self.clock_error, "events": events}

    def flush(self) -> None:
        """Stop recording; every rank posts its events and rank 0 writes the merged trace and the summary. Once."""
        if self.done:
            return
        self.done, self.active = True, False
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.path is None:
            return  # a benchmark's or a test's timeline: the events stay here
        payloads = {self.rank: self.payload()}
        if self.store is not None and self.world_size > 1:
            try:
                timeline_trace.publish(self.store, self.prefix, self.rank, payloads[self.rank])
                if self.rank == 0:
                    payloads = timeline_trace.gather(self.store, self.prefix, self.world_size,
                                                     self.gather_timeout_s)
            except Exception as exc:  # the store is gone with its host: the job is failing, and its next
                # collective says why (a peer that vanished), which a store error raised from here would hide
                warnings.warn(f"ddpkit timeline: the ranks could not meet in the store to merge the trace "
                              f"({exc!r}); rank 0 writes only its own events", RuntimeWarning, stacklevel=2)
            if self.rank != 0:
                return
        # Usually from inside an optimizer step (the hook that ended step B): a trace that cannot be written (a
        # full disk, a folder that became read-only) costs the trace, never the training run. Once per timeline,
        # as flush is.
        try:
            self._write(payloads)
        except Exception as exc:
            failed = exc.filename if isinstance(exc, OSError) and exc.filename else self.path
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else repr(exc)
            warnings.warn(f"ddpkit timeline: could not write {failed} ({reason}); training goes on without the "
                          "trace. Check the free space and the permissions of its folder, or record the timeline "
                          "to another path", RuntimeWarning, stacklevel=2)

    def _write(self, payloads: dict[int, dict]) -> None:
        taken = self.step - 1  # the last optimizer step completed: below B when the run ended first
        asked = [self.first, taken if self.last == math.inf else self.last]
        trace = timeline_trace.build_trace(payloads, self.world_size, asked, last_step=taken)
        self.summary = timeline_summary.summarize(trace)
        print(timeline_summary.format_summary(self.summary), flush=True)
        timeline_trace.write_json(self.path, trace)
        timeline_trace.write_json(summary_path(self.path), self.summary)
        print(f"[ddpkit] timeline: wrote {self.path} (open it in https://ui.perfetto.dev or chrome://tracing) "
              f"and {summary_path(self.path)}", flush=True)


# -- attaching: who records -------------------------------------------------------------------------------------------

def recorder_for(comm: Any) -> NullRecorder:
    """The timeline recording `comm`'s collectives: the one attached, else the one `ddpkit launch --timeline`
    asked for (DDPKIT_TIMELINE, attached now: every rank must call this at the same point, as wrapping a model
    in DistributedDataParallel is), else NULL_RECORDER."""
    for observer in comm.observers:
        if isinstance(observer, Timeline) and not observer.done:
            return observer
    request = timeline_spec.request()
    if request is None or not comm.active:
        return NULL_RECORDER
    path, steps = request
    return start_timeline(comm, steps, path)


def attach_timeline(comm: Any, steps: str | None, output_dir: str) -> NullRecorder:
    """The Trainer's: the launcher's timeline if there is one, else one for `steps` ("A:B", ddp_timeline_steps)
    written to output_dir/timeline.json, else NULL_RECORDER. Before the model is wrapped, so DDP finds it."""
    found = recorder_for(comm)
    if found is not NULL_RECORDER or steps is None or not comm.active:
        return found
    path = os.path.join(output_dir, TRACE_FILE)
    # Every rank checks, so that all of them refuse together instead of some waiting for the others' clocks.
    problem = output_path_problem(path, make_folder=True)  # the Trainer creates output_dir
    if problem is not None:
        raise ArgumentError("ddp_timeline_steps", f"the timeline is written to output_dir/{TRACE_FILE}, and "
                            f"{path!r} {problem}; choose an output_dir you can write in, without a folder named "
                            f"{TRACE_FILE} in it")
    return start_timeline(comm, parse_steps(steps), path)


def start_timeline(comm: Any, steps: tuple[int, int], path: str) -> Timeline:
    """A timeline of steps A..B on `comm`'s ranks (all of them call this together: the clocks are compared)."""
    store = dist.distributed_c10d._get_default_store()
    # Ranks count their timelines in the store, so a second one in the same job never reads the first one's keys.
    generation = (store.add("ddpkit/timeline/started", 1) - 1) // comm.world_size
    prefix = f"ddpkit/timeline/{generation}/"
    clock = timeline_clock.measure_offset(store, comm.rank, comm.world_size, prefix + "clock/")
    if path and comm.rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    timeline = Timeline(comm.rank, comm.world_size, steps, path, store, prefix, clock)
    timeline.watch_optimizers()
    comm.add_observer(timeline)
    # A run that ends before step B without destroy_process_group (which closes the observers) still writes the
    # steps it took, while the store is there.
    atexit.register(timeline.flush)
    if comm.rank == 0:
        print(f"[ddpkit] timeline: recording optimizer steps {steps[0]} to {steps[1]} into {path}",
              file=sys.stderr, flush=True)
    return timeline


def load_trace(path: str) -> dict[str, Any]:
    """A trace written by a timeline, checked to be one."""
    with open(path, encoding="utf-8") as f:
        trace = json.load(f)
    if not isinstance(trace, dict) or "traceEvents" not in trace or "ddpkit" not in trace.get("otherData", {}):
        raise ValueError(f"{path} is not a trace written by ddpkit's timeline (no traceEvents/otherData.ddpkit)")
    return trace


__all__ = ["CHECKPOINT", "DATA_WAIT", "EVALUATION", "NULL_RECORDER", "Timeline", "attach_timeline", "load_trace",
           "recorder_for", "start_timeline"]
