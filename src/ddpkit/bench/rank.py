"""One rank of a benchmark world: build every variant of a model, warm up, time interleaved rounds."""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import time
import traceback
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ddpkit._utils.procfs import die_with_parent
from ddpkit.bench.workloads import WORKLOADS, Workload
from ddpkit.distributed.comm import Comm, barrier
from ddpkit.world import destroy_process_group
from ddpkit.distributed.env import init_process_group
from ddpkit.doctor.inspector import attach_stall_monitor
from ddpkit.engine.ddp import DistributedDataParallel

VARIANTS = ("ddpkit", "torch", "bare")


def variants_of(cfg) -> tuple[str, ...]:
    return VARIANTS + (("inspected",) if cfg.inspector else ()) + (("timeline",) if cfg.timeline else ())


def round_order(round_index: int, variants: Sequence[str] = VARIANTS) -> list[str]:
    """The variants in the order round `round_index` runs them: rotated by one each round."""
    k = round_index % len(variants)
    return list(variants[k:]) + list(variants[:k])


def _make_variant(variant: str, workload: Workload, cfg) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(cfg.seed)  # the same initial weights in every variant and on every rank
    model = workload.build()
    kwargs = {} if cfg.bucket_cap_mb is None else {"bucket_cap_mb": cfg.bucket_cap_mb}
    if variant in ("ddpkit", "inspected", "timeline"):
        model = DistributedDataParallel(model, **kwargs)
    elif variant == "torch":
        model = torch.nn.parallel.DistributedDataParallel(model, **kwargs)
    if cfg.compile:
        # torch.compile(wrapper): Dynamo compiles the wrapped module while the wrapper's forward names itself
        # the active DDP module, so both wrappers' graphs are split at their bucket boundaries.
        model = torch.compile(model, backend=cfg.compile)
    return model, torch.optim.SGD(model.parameters(), lr=cfg.lr)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, workload: Workload, batch) -> tuple[float, float]:
    """(wall, CPU) seconds of one training step. CPU time counts every thread of this process, gloo's too, and
    leaves out time spent descheduled, so on a busy machine it shows a wrapper's own cost more steadily."""
    wall, cpu = time.perf_counter(), time.process_time()
    optimizer.zero_grad(set_to_none=True)
    workload.loss(model, batch).backward()
    optimizer.step()
    return time.perf_counter() - wall, time.process_time() - cpu


def measure_model(name: str, world, cfg, monitor: Any = None) -> dict[str, Any]:
    """This rank's step times in seconds: {"params", "tensors", "wall": {variant: [per round: [per step]]},
    "cpu": {the same}}."""
    workload = WORKLOADS[name]
    variants = variants_of(cfg)
    runs = {v: _make_variant(v, workload, cfg) for v in variants}
    batch = workload.batch(torch.Generator().manual_seed(1000 * cfg.seed + world.rank))  # each rank its own shard
    comm = Comm.for_group()
    # The inspector's thread runs all along (about one store write a second); what differs between "ddpkit" and
    # "inspected" is whether its collectives are reported to it, which is the cost on the step's path. It is the
    # world's one inspector (rank_main's): closing it would post that this rank left the job.
    timeline = _timeline_variant(runs["timeline"], world) if cfg.timeline else None
    # (No inspector in a world of one: nothing to watch.)
    observers = {"inspected": [monitor] if monitor is not None else [], "timeline": [timeline] if timeline else []}
    for variant in variants:
        comm.observers = observers.get(variant, [])
        for _ in range(cfg.warmup):
            _step(*runs[variant], workload, batch)
    wall: dict[str, list[list[float]]] = {v: [] for v in variants}
    cpu: dict[str, list[list[float]]] = {v: [] for v in variants}
    for r in range(cfg.repeats):
        for variant in round_order(r, variants):
            barrier(world)
            comm.observers = observers.get(variant, [])
            block = [_step(*runs[variant], workload, batch) for _ in range(cfg.steps)]
            wall[variant].append([w for w, _ in block])
            cpu[variant].append([c for _, c in block])
    if timeline is not None:
        timeline.close()
    comm.observers = [monitor] if monitor is not None else []  # destroy_process_group closes it
    params = list(runs["bare"][0].parameters())
    with torch.no_grad():
        losses = {v: workload.loss(runs[v][0], batch).item() for v in variants}
    bad = {v: x for v, x in losses.items() if not math.isfinite(x)}
    if bad:  # a diverged model runs on denormals and NaNs, whose speed says nothing about the wrapper
        raise FloatingPointError(f"{name}: the loss became non-finite ({bad}); lower --lr or the number of steps")
    return {"params": sum(p.numel() for p in params), "tensors": len(params), "wall": wall, "cpu": cpu}


def _timeline_variant(run: tuple[nn.Module, torch.optim.Optimizer], world) -> Any:
    """A timeline recording every step of this variant only: its reducer records into it, its optimizer's steps
    delimit the timeline's (the hooks a real run registers globally), and it is its Comm's observer while it runs."""
    from ddpkit.timeline.recorder import Timeline

    model, optimizer = run
    timeline = Timeline(world.rank, world.world_size)
    reducer = getattr(model, "reducer", None)  # through torch.compile's wrapper too; None in a world of one
    if reducer is not None:
        reducer.recorder = timeline
    optimizer.register_step_pre_hook(timeline._before_optimizer)
    optimizer.register_step_post_hook(timeline._after_optimizer)
    return timeline


def become_rank(rank: int, world_size: int, port: int) -> None:
    """What every benchmark rank (this module's, bench_zero's) does first, before it joins the world."""
    # The parent owns Ctrl-C and SIGTERM: it stops every rank, so a rank must not die half-way through a collective
    # alone, and must not outlive the parent either.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    # The launcher's variables, as torchrun would set them, read by ddpkit.init_process_group.
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))


def rank_main(rank: int, world_size: int, port: int, cfg, results) -> None:
    become_rank(rank, world_size, port)
    try:
        torch.set_num_threads(cfg.threads)
        torch.set_flush_denormal(True)
        world = init_process_group(backend="gloo", device_type="cpu", timeout=cfg.timeout_s)
        try:
            comm = Comm.for_group()
            monitor = attach_stall_monitor(comm, cfg.timeout_s, cfg.timeout_s / 5) if cfg.inspector else None
            out = {}
            for name in cfg.models:
                out[name] = measure_model(name, world, cfg, monitor)
                if rank == 0:
                    results.put(("progress", rank, f"world of {world_size}: {name} done"))
        finally:
            destroy_process_group()
        results.put(("ok", rank, out if rank == 0 else None))
    except BaseException as exc:  # noqa: BLE001 - the parent must hear about every failure
        results.put(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _die_with_parent() -> None:
    """Ask Linux to kill this rank if the parent dies without cleaning up (SIGKILL, a crash)."""
    if not die_with_parent():
        return  # not Linux: the parent's deadline and cleanup still apply
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:
        os._exit(1)  # the parent died while this rank was starting, before the request above could take effect
