"""`ddpkit bench --zero`: ZeRO step time and optimizer-state memory against DDP, torch's ZeRO and FSDP2.

    ddpkit bench --zero                          # 2 gloo ranks, the MLP and the transformer, AdamW
    python -m ddpkit.bench.zero --repeats 12 --models mlp

Every variant trains the same model with AdamW from the same seed on every rank, interleaved in rounds with the
order rotated each round (as `ddpkit bench` does), a barrier before every timed block:

    ddpkit        ddpkit's DDP + AdamW
    ddpkit-z1     ddpkit's DDP + ddpkit.ZeroRedundancyOptimizer (stage 1)
    ddpkit-z2     ddpkit's DDP(zero_stage=2) + ddpkit.ZeroRedundancyOptimizer (stage 2)
    torch         torch's DDP + AdamW (the denominator of every ratio)
    torch-zero    torch's DDP + torch's ZeroRedundancyOptimizer
    fsdp2         torch's fully_shard(reshard_after_forward=False) + AdamW (stage 2 in FSDP2's terms)

Reported: rank 0's median step time per variant (each round's: a block of steps, its last all-gathers waited
for, over the number of steps), its ratio to torch's DDP (median of the per-round ratios
[min-max]), the same ratio of process CPU time (`cpu`: every thread of the rank, gloo's included; it leaves
out time spent descheduled or waiting for the other rank, so it moves less on a shared machine), and per rank
the optimizer-state bytes, the gradient bytes held after backward and the peak of live tensor bytes
(ddpkit.bench.zero_memory says exactly what each counts).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ddpkit._utils.atomic import replacing
from ddpkit.bench.rank import become_rank
from ddpkit.bench.runner import (
    WORKLOADS,
    bounded,
    check_json_path,
    ratio_stats,
    round_order,
    run_interruptible,
    run_ranks,
)
from ddpkit.bench.zero_memory import grad_bytes, peak_bytes, state_bytes

VARIANTS = ("ddpkit", "ddpkit-z1", "ddpkit-z2", "torch", "torch-zero", "fsdp2")
LR = 1e-4
# What `ddpkit bench --help` says of --zero (the table itself is the docstring's).
SUMMARY = ("It trains each model from the same seed with AdamW under six variants: ddpkit's DDP alone, with ddpkit's "
           "ZeroRedundancyOptimizer (stage 1) and with DDP(zero_stage=2) (stage 2), against torch's DDP alone, with "
           "torch's ZeroRedundancyOptimizer, and FSDP2. It prints one row per model and variant; the columns: "
           "median step time (ms), its ratio to torch's DDP [min-max over rounds], the same ratio of CPU time, then "
           "for each rank the optimizer-state, gradient and peak tensor memory (MiB).")


def _make(variant: str, name: str, seed: int):
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import ddpkit

    torch.manual_seed(seed)
    model = WORKLOADS[name].build()
    if variant == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for layer in list(model.modules()):  # pre-order: a block before the layers inside it
            if isinstance(layer, (torch.nn.Linear, torch.nn.TransformerEncoderLayer)) and \
                    not any(hasattr(p, "to_local") for p in layer.parameters()):  # not in a sharded block
                fully_shard(layer, mesh=mesh, reshard_after_forward=False)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        return model, torch.optim.AdamW(model.parameters(), lr=LR)
    if variant.startswith("ddpkit"):
        model = ddpkit.DistributedDataParallel(model, zero_stage=2 if variant == "ddpkit-z2" else 0)
    else:
        model = TorchDDP(model)
    if variant in ("ddpkit-z1", "ddpkit-z2"):
        return model, ddpkit.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=LR)
    if variant == "torch-zero":
        return model, TorchZero(model.parameters(), torch.optim.AdamW, lr=LR)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def _step(model, optimizer, workload, batch, wait: bool = False) -> None:
    """One training step."""
    optimizer.zero_grad(set_to_none=True)
    workload.loss(model, batch).backward()
    optimizer.step()
    if wait and hasattr(optimizer, "wait_for_params"):
        optimizer.wait_for_params()  # stage 2's gathers, else left in flight when the peak run ends


def _block(model, optimizer, workload, batch, steps: int) -> tuple[float, float]:
    """`steps` training steps: (wall-clock seconds, process CPU seconds of every thread of this rank) per step.
    The last step waits for its parameters: stage 2 leaves its all-gathers in flight into the next forward,
    which is inside the block for every step but the last, whose gathers would otherwise go untimed."""
    began, cpu = time.perf_counter(), time.process_time()
    for index in range(steps):
        _step(model, optimizer, workload, batch, wait=index == steps - 1)
    return (time.perf_counter() - began) / steps, (time.process_time() - cpu) / steps


def measure(name: str, rank: int, steps: int, warmup: int, repeats: int) -> dict[str, Any]:
    from ddpkit.distributed.comm import Comm

    workload = WORKLOADS[name]
    runs = {v: _make(v, name, 0) for v in VARIANTS}
    batch = workload.batch(torch.Generator().manual_seed(rank))
    comm = Comm.for_group()
    for variant in VARIANTS:
        for _ in range(warmup):
            _step(*runs[variant], workload, batch)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(repeats):
        for variant in round_order(r, VARIANTS):
            comm.barrier("bench round")
            wall, used = _block(*runs[variant], workload, batch, steps)
            times[variant].append(wall)
            cpu[variant].append(used)
    memory = {v: state_bytes(runs[v][1]) for v in VARIANTS}
    grads = {v: _grads_after_backward(*runs[v], workload, batch) for v in VARIANTS}
    del runs
    peaks = {v: peak_bytes(functools.partial(_make, v, name, 0),
                           lambda run: _step(*run, workload, batch, wait=True), warmup + 1) for v in VARIANTS}
    return {"times": times, "cpu": cpu, "state_bytes": memory, "grad_bytes": grads, "peak_bytes": peaks,
            "params": sum(p.numel() for p in WORKLOADS[name].build().parameters())}


def _grads_after_backward(model, optimizer, workload, batch) -> int:
    """One more step, with the gradient storage counted between its backward and its optimizer step."""
    optimizer.zero_grad(set_to_none=True)
    workload.loss(model, batch).backward()
    held = grad_bytes(model)
    optimizer.step()
    return held


def _rank_main(rank, world_size, port, models, steps, warmup, repeats, timeout_s, results) -> None:
    become_rank(rank, world_size, port)
    try:
        import ddpkit

        torch.set_num_threads(1)
        # FSDP2 warns at every forward that the MLP's output is a view; the comparison does not modify it in place.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
        # A collective never waits longer than the whole run may last (the parent ends the ranks at that deadline).
        ddpkit.init_process_group(backend="gloo", device_type="cpu", timeout=timeout_s)
        try:
            out = {}
            for name in models:
                began = time.monotonic()
                out[name] = measure(name, rank, steps, warmup, repeats)
                if rank == 0:
                    results.put(("progress", rank, f"{name}: measured in {time.monotonic() - began:.0f} s"))
        finally:
            ddpkit.destroy_process_group()
        results.put(("ok", rank, out))
    except BaseException as exc:  # noqa: BLE001 - the parent must hear of every failure
        results.put(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run(models: Sequence[str], world_size: int = 2, steps: int = 3, warmup: int = 2, repeats: int = 6,
        timeout_s: float = 900.0, progress: Callable[[str], None] = lambda line: None) -> list[dict[str, Any]]:
    """Every rank's measurements; no rank outlives the call (bench.run_ranks: a failure raises BenchError)."""
    for name, value, low in (("world_size", world_size, 1), ("steps", steps, 1), ("warmup", warmup, 0),
                             ("repeats", repeats, 1)):
        if value < low:
            raise ValueError(f"bench --zero: {name} must be >= {low}, got {value}")
    hint = f"{timeout_s:.0f} s; raise it with --timeout"
    done = run_ranks(_rank_main, world_size, (tuple(models), steps, warmup, repeats, timeout_s),
                     time.monotonic() + timeout_s, hint, progress)
    return [done[r] for r in range(world_size)]


def format_table(per_rank: list[dict[str, Any]]) -> str:
    ranks = range(len(per_rank))
    lines = [f"{'model':<12} {'variant':<11} {'ms':>8} {'/torch':<20} {'cpu':>5} " +
             " ".join(f"{kind + ' r' + str(r):>10}" for kind in ("state", "grads", "peak") for r in ranks)]
    for name, measured in per_rank[0].items():
        torch_rounds = measured["times"]["torch"]
        for variant in VARIANTS:
            rounds = measured["times"][variant]
            ratio = ratio_stats(rounds, torch_rounds)
            cpu = ratio_stats(measured["cpu"][variant], measured["cpu"]["torch"])["median"]
            memory = " ".join(f"{r[name][kind + '_bytes'][variant] / 2**20:>8.2f}Mi"
                              for kind in ("state", "grad", "peak") for r in per_rank)
            lines.append(f"{name:<12} {variant:<11} {1e3 * statistics.median(rounds):>8.2f} "
                         f"{ratio['median']:.3f} [{ratio['min']:.2f}-{ratio['max']:.2f}]  {cpu:.2f}  {memory}")
    return "\n".join(lines)


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--zero", action="store_true", help=argparse.SUPPRESS)  # how `ddpkit bench` hands over
    parser.add_argument("--models", nargs="+", choices=list(WORKLOADS), default=["mlp", "transformer"],
                        help="models to run (default: %(default)s)")
    parser.add_argument("--world-size", type=bounded(int, 1), default=2, help="ranks (default %(default)s)")
    parser.add_argument("--steps", type=bounded(int, 1), default=3,
                        help="timed steps per variant per round (default %(default)s)")
    parser.add_argument("--warmup", type=bounded(int, 0), default=2,
                        help="untimed steps per variant before the rounds (default %(default)s)")
    parser.add_argument("--repeats", type=bounded(int, 1), default=6,
                        help="rounds (the order rotates each round; default %(default)s)")
    parser.add_argument("--timeout", type=bounded(float, 0, strict=True), default=900.0,
                        help="deadline for the whole run, seconds (default %(default)s)")
    parser.add_argument("--json", metavar="PATH", help="also write every number (per rank, per round) here")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "ddpkit bench --zero") -> int:
    parser = _parser(prog)
    args = parser.parse_args(argv)
    check_json_path(parser, args.json)
    progress = (lambda line: None) if args.quiet else (
        lambda line: print(f"[bench --zero] {line}", file=sys.stderr, flush=True))
    per_rank, code = run_interruptible("ddpkit bench --zero", lambda: run(
        args.models, args.world_size, args.steps, args.warmup, args.repeats, args.timeout, progress))
    if code:
        return code
    print(f"ddpkit bench --zero: AdamW, gloo, {args.world_size} ranks x 1 thread, rank 0 medians of "
          f"{args.repeats} rounds x {args.steps} steps")
    print(format_table(per_rank))
    if args.json:
        options = {k: v for k, v in vars(args).items() if k not in ("zero", "json", "quiet")}
        with replacing(args.json) as f:
            json.dump({"options": options, "variants": list(VARIANTS), "torch": torch.__version__,
                       "per_rank": per_rank}, f, indent=1)
    return 0

