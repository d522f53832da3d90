"""The memory figures of `ddpkit bench --zero`, per variant and rank (what each one counts, exactly):

    state   optimizer-state bytes: the tensors in the (local) optimizer's state; FSDP2's local shards
    grads   gradient bytes after backward, before the step:
              ddpkit variants  every gradient storage the wrapper references: the reducer's bucket storage
                               (while it exists), stage 2's shards and every .grad, each storage counted once
              torch, torch-zero  the .grad tensors only: torch's reducer keeps its bucket storage in C++, out of
                               Python's sight (with gradient_as_bucket_view=False, as here, one more full copy)
              fsdp2            the local shards of the sharded .grad
    peak    the peak of live CPU tensor bytes the variant allocated, from its construction through `steps`
            steps: the variant is built and trained inside torch.profiler(profile_memory=True) and the
            allocations minus frees the profiler records are summed in time order. It counts what torch's
            allocator hands out on the training thread (parameters, buckets, gradients, optimizer state,
            activations, collective outputs), nothing of gloo's own transport buffers or of other threads.
            Ranks may differ by a collective's temporary buffers (which rank's thread makes them).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state on this rank (a sharded optimizer's local state; FSDP2's local shards)."""
    inner = getattr(optimizer, "optim", optimizer)
    total = 0
    for state in inner.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total


def grad_bytes(model: torch.nn.Module) -> int:
    """Gradient storage this rank holds now (see the module docstring for what each variant counts)."""
    from ddpkit.engine.sharded_grads import storage_bytes

    shards = getattr(model, "_grad_shards", None)
    if shards is not None:
        return shards.held_bytes()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    reducer = getattr(model, "reducer", None)
    buckets = getattr(reducer, "buckets", None)
    if isinstance(buckets, list):  # ddpkit's reducer (torch's is a C++ object without this list)
        grads += [b.storage for b in buckets if b.allocated]
    return storage_bytes(grads)


def peak_bytes(build: Callable[[], Any], step: Callable[[Any], None], steps: int) -> int:
    """The peak of live CPU tensor bytes allocated while `build()` runs and then `step(built)` `steps` times."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frees of blocks allocated before profiling are left out: intended
        with _profiler_chatter_dropped():
            prof.start()
        try:
            built = build()
            for _ in range(steps):
                step(built)
            del built
        finally:
            with _profiler_chatter_dropped():
                prof.stop()
    records = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == torch._C._autograd.DeviceType.CPU)
    live = peak = 0
    for _, nbytes in records:
        live += nbytes
        peak = max(peak, live)
    return peak


@contextlib.contextmanager
def _profiler_chatter_dropped() -> Iterator[None]:
    """The profiler's C++ side (kineto) prints lines such as "USDT:... profiler_start" to stderr at each start and
    stop, whatever its log level: while it starts or stops, this process's stderr goes to a temporary file, and
    every other line is passed on afterwards."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            lines = caught.read().decode(errors="replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if not line.startswith(("USDT:", "STAGE:")))
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()
