"""Step time of ddpkit's DistributedDataParallel against torch's and against the bare model, on this machine.

    python -m ddpkit.bench                                   # 2 gloo ranks, then a world of one; ~1 min, 2 cores
    python -m ddpkit.bench --models many-small --repeats 30  # one model, more rounds for a tighter spread
    python -m ddpkit.bench --world-size 4 --threads 1 --json bench.json
    ddpkit bench --world-size 2                              # the same through the CLI

Each world is a fresh set of CPU processes joined over gloo on loopback. On every rank, each model is built
three times from the same seed: wrapped in ddpkit's DDP, wrapped in torch's DDP, and bare (no wrapper, no
communication). A step is zero_grad, forward, backward and an SGD step, timed with time.perf_counter (CPU ops
are synchronous, and both wrappers wait for their all-reduces before backward returns). After a warm-up, the
variants run in rounds of `--steps` steps each, interleaved and with their order rotated every round, so that
a noisy machine slows all three alike; a barrier lines the ranks up before every timed block.

Rank 0's numbers are reported: each variant's median step time over all rounds, and each ratio as the median
of the per-round ratios [min-max]. The `cpu` columns are the same ratios of process CPU time, which leaves out
time spent descheduled and so moves less when other jobs share the cores (but also leaves out waiting for the
other ranks). In a world of one ddpkit's wrapper does no work, so ddpkit/bare there should be within 2%.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import multiprocessing as mp
import os
import platform
import queue
import signal
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .comm import barrier
from .ddp import DistributedDataParallel
from .comm import Comm
from .env import destroy_process_group, free_port, init_process_group
from .monitor import attach_stall_monitor

VARIANTS = ("ddpkit", "torch", "bare")
RATIOS = (("ddpkit", "torch"), ("ddpkit", "bare"))


# -- the workloads -------------------------------------------------------------------------------------------------
class MLP(nn.Module):
    """Few large matrices: all-reduce bandwidth dominates the DDP cost."""

    def __init__(self, width: int = 512, hidden: int = 2048, classes: int = 10):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, width), nn.ReLU(), nn.Linear(width, classes))

    def forward(self, x):
        return self.net(x)


class Transformer(nn.Module):
    """A small causal language model: a few dozen tensors of mixed sizes."""

    def __init__(self, vocab: int = 2000, d_model: int = 128, heads: int = 4, layers: int = 2, length: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(length, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=4 * d_model, dropout=0.0,
                                           batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab)

    def forward(self, tokens):
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.out(self.norm(self.blocks(h, mask=mask, is_causal=True)))


class CNN(nn.Module):
    """Convolutions with BatchNorm: both wrappers broadcast the running statistics at every forward."""

    def __init__(self, classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = []
        for c_in, c_out in ((3, 32), (32, 64), (64, 128)):
            layers += [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(),
                       nn.MaxPool2d(2)]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(128, classes)

    def forward(self, x):
        return self.head(self.features(x).mean(dim=(2, 3)))


class ManySmall(nn.Module):
    """500 tiny tensors and little arithmetic, so what each wrapper spends per parameter is what shows."""

    def __init__(self, layers: int = 250, width: int = 16):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))  # weight + bias each

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model, one rank's fixed batch for it, and its loss."""

    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[nn.Module, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]
    about: str


def _classify(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def _next_token(model, batch):
    tokens, targets = batch
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _regress(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def _tokens(g: torch.Generator, n: int = 8, length: int = 64, vocab: int = 2000):
    seq = torch.randint(0, vocab, (n, length + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


# Batch sizes are per rank, chosen (empirically, 2 CPU cores) so that a step takes a few to a few tens of ms.
WORKLOADS: dict[str, Workload] = {
    "mlp": Workload(MLP, lambda g: (torch.randn(32, 512, generator=g), torch.randint(0, 10, (32,), generator=g)),
                    _classify, "4 linear layers, ~6.3M parameters, batch 32"),
    "transformer": Workload(Transformer, _tokens, _next_token, "2 encoder layers, d_model 128, 8 x 64 tokens"),
    "cnn": Workload(CNN, lambda g: (torch.randn(16, 3, 32, 32, generator=g),
                                    torch.randint(0, 10, (16,), generator=g)),
                    _classify, "3 conv+BatchNorm blocks, 16 images 32x32"),
    "many-small": Workload(ManySmall, lambda g: (torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)),
                           _regress, "250 linear 16x16 layers = 500 tensors, batch 8"),
}


# -- configuration -------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """One benchmark run; every rank of every world gets the same copy."""

    world_size: int = 2  # ranks of the distributed world (processes on this machine)
    single: bool = True  # also measure a world of one after it
    models: tuple[str, ...] = tuple(WORKLOADS)
    steps: int = 6  # timed steps per variant per round
    warmup: int = 3  # untimed steps per variant first: ddpkit learns its buckets, torch rebuilds its own
    repeats: int = 9  # rounds; the variant order is rotated each round, so a multiple of 3 is fair
    bucket_cap_mb: float | None = None  # passed to both wrappers; None keeps their default (25 MiB both)
    threads: int = 1  # torch intra-op threads per rank
    seed: int = 0
    lr: float = 1e-3  # SGD; small so that many steps on one fixed batch stay finite
    timeout_s: float = 600.0  # deadline for the whole run, every world included
    inspector: bool = False  # add "inspected": ddpkit's DDP with the stall inspector watching its collectives
    timeline: bool = False  # add "timeline": ddpkit's DDP recording a timeline of every step (timeline.py)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.models) - set(WORKLOADS))
        if unknown or not self.models:
            raise ValueError(f"unknown or no models {unknown}; choose from {', '.join(WORKLOADS)}")
        for name in ("world_size", "steps", "repeats", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.bucket_cap_mb is not None and not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {self.bucket_cap_mb}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout must be positive, got {self.timeout_s} s")

    @property
    def world_sizes(self) -> list[int]:
        return [self.world_size] + ([1] if self.single and self.world_size != 1 else [])


# -- one rank: build, warm up, time interleaved rounds ---------------------------------------------------------------
def variants_of(cfg: BenchConfig) -> tuple[str, ...]:
    return VARIANTS + (("inspected",) if cfg.inspector else ()) + (("timeline",) if cfg.timeline else ())


def round_order(round_index: int, variants: Sequence[str] = VARIANTS) -> list[str]:
    """The variants in the order round `round_index` runs them: rotated by one each round."""
    k = round_index % len(variants)
    return list(variants[k:]) + list(variants[:k])


def _make_variant(variant: str, workload: Workload, cfg: BenchConfig) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(cfg.seed)  # the same initial weights in every variant and on every rank
    model = workload.build()
    kwargs = {} if cfg.bucket_cap_mb is None else {"bucket_cap_mb": cfg.bucket_cap_mb}
    if variant in ("ddpkit", "inspected", "timeline"):
        model = DistributedDataParallel(model, **kwargs)
    elif variant == "torch":
        model = torch.nn.parallel.DistributedDataParallel(model, **kwargs)
    return model, torch.optim.SGD(model.parameters(), lr=cfg.lr)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, workload: Workload, batch) -> tuple[float, float]:
    """(wall, CPU) seconds of one training step. CPU time counts every thread of this process, gloo's too, and
    leaves out time spent descheduled, so on a busy machine it shows a wrapper's own cost more steadily."""
    wall, cpu = time.perf_counter(), time.process_time()
    optimizer.zero_grad(set_to_none=True)
    workload.loss(model, batch).backward()
    optimizer.step()
    return time.perf_counter() - wall, time.process_time() - cpu


def measure_model(name: str, world, cfg: BenchConfig) -> dict[str, Any]:
    """This rank's step times in seconds: {"params", "tensors", "wall": {variant: [per round: [per step]]},
    "cpu": {the same}}."""
    workload = WORKLOADS[name]
    variants = variants_of(cfg)
    runs = {v: _make_variant(v, workload, cfg) for v in variants}
    batch = workload.batch(torch.Generator().manual_seed(1000 * cfg.seed + world.rank))  # each rank its own shard
    comm = Comm.for_group()
    # The inspector's thread runs all along (about one store write a second); what differs between "ddpkit" and
    # "inspected" is whether its collectives are reported to it, which is the cost on the step's path.
    monitor = attach_stall_monitor(comm, cfg.timeout_s, cfg.timeout_s / 5) if cfg.inspector else None
    timeline = _timeline_variant(runs["timeline"], world) if cfg.timeline else None
    observers = {"inspected": [monitor], "timeline": [timeline]}
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
    comm.observers = [monitor] if monitor is not None else []
    comm.close_observers()
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
    from .timeline import Timeline

    model, optimizer = run
    timeline = Timeline(world.rank, world.world_size)
    if model.reducer is not None:
        model.reducer.recorder = timeline
    optimizer.register_step_pre_hook(timeline._before_optimizer)
    optimizer.register_step_post_hook(timeline._after_optimizer)
    return timeline


def _rank_main(rank: int, world_size: int, port: int, cfg: BenchConfig, results) -> None:
    # The parent owns Ctrl-C: it stops every rank, so a rank must not die half-way through a collective alone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    # The launcher's variables, as torchrun would set them, read by ddpkit.init_process_group.
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    try:
        torch.set_num_threads(cfg.threads)
        torch.set_flush_denormal(True)
        world = init_process_group(backend="gloo", timeout=cfg.timeout_s)
        try:
            out = {}
            for name in cfg.models:
                out[name] = measure_model(name, world, cfg)
                if rank == 0:
                    results.put(("progress", rank, f"world of {world_size}: {name} done"))
        finally:
            destroy_process_group()
        results.put(("ok", rank, out if rank == 0 else None))
    except BaseException as exc:  # noqa: BLE001 - the parent must hear about every failure
        results.put(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _die_with_parent() -> None:
    """Ask Linux to kill this rank if the parent dies without cleaning up (SIGKILL, a crash)."""
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the parent's deadline and cleanup still apply


# -- the parent: spawn one world, collect rank 0's numbers, never leave a process behind -------------------------
class BenchError(RuntimeError):
    """A rank failed, died or missed the deadline; every rank of that world has been stopped."""


def run_world(world_size: int, cfg: BenchConfig, deadline: float,
              progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Rank 0's measurements for every model in a fresh world of `world_size` ranks (deadline: time.monotonic)."""
    ctx = mp.get_context("spawn")  # fresh interpreters: no thread pools or locks inherited from the caller
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, world_size, port, cfg, results), daemon=True,
                         name=f"ddpkit-bench-rank{rank}") for rank in range(world_size)]
    done: dict[int, Any] = {}
    try:
        for proc in procs:
            proc.start()
        while len(done) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(done))
                raise BenchError(f"world of {world_size}: ranks {missing} had not finished at the deadline "
                                 f"({cfg.timeout_s:.0f} s for the whole run; raise it with --timeout)")
            try:
                kind, rank, payload = results.get(timeout=min(left, 0.5))
            except queue.Empty:
                dead = {r: p.exitcode for r, p in enumerate(procs) if r not in done and p.exitcode is not None}
                if dead:
                    try:  # its last message may still be in the pipe
                        kind, rank, payload = results.get(timeout=1.0)
                    except queue.Empty:
                        raise BenchError(f"world of {world_size}: ranks died without a word (exit codes {dead})") \
                            from None
                else:
                    continue
            if kind == "progress":
                progress(payload)
            elif kind == "error":
                raise BenchError(f"world of {world_size}: rank {rank} failed:\n{payload}")
            else:
                done[rank] = payload
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.join(timeout=5 if len(done) == world_size else 0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        results.close()
        results.cancel_join_thread()  # nobody is left to read; never block on a full pipe
    return done[0]


# -- the summary: pure ---------------------------------------------------------------------------------------------
def summarise(world_size: int, name: str, measured: dict[str, Any]) -> dict[str, Any]:
    """Medians in ms and ratios from one model's per-round step times (seconds) on rank 0."""
    row = {"world_size": world_size, "model": name, "about": WORKLOADS[name].about, "params": measured["params"],
           "tensors": measured["tensors"]}
    for clock, prefix in (("wall", ""), ("cpu", "cpu_")):
        steps = measured[clock]
        variants = list(steps)
        ratios = RATIOS + tuple((v, "ddpkit") for v in ("inspected", "timeline") if v in steps)
        round_ms = {v: [1e3 * statistics.median(block) for block in steps[v]] for v in variants}
        row[prefix + "median_ms"] = {v: 1e3 * statistics.median([t for block in steps[v] for t in block])
                                     for v in variants}
        row[prefix + "ratios"] = {f"{num}/{den}": ratio_stats(round_ms[num], round_ms[den]) for num, den in ratios}
        row[prefix + "round_median_ms"] = round_ms
        row[prefix + "step_ms"] = {v: [[1e3 * t for t in block] for block in steps[v]] for v in variants}
    return row


def ratio_stats(numerator: Sequence[float], denominator: Sequence[float]) -> dict[str, Any]:
    """The ratio of two variants per round, summarised. Blocks of one round ran back to back, so each ratio
    sees roughly the same machine; the spread over rounds shows how far the machine's noise moves it."""
    per_round = [a / b for a, b in zip(numerator, denominator, strict=True)]
    return {"median": statistics.median(per_round), "min": min(per_round), "max": max(per_round),
            "rounds": per_round}


def format_table(rows: list[dict[str, Any]]) -> str:
    """Wall-clock medians and ratios [min-max over rounds], then the CPU-time ratios (medians) beside them."""
    head = (f"{'world':>5}  {'model':<11} {'params':>6} {'tensors':>7}  {'ddpkit ms':>9} {'torch ms':>9} "
            f"{'bare ms':>8}  {'ddpkit/torch':<21} {'ddpkit/bare':<21} {'cpu d/t':>7} {'cpu d/b':>7}")
    lines = [head, "-" * len(head)]
    for row in rows:
        ms = row["median_ms"]
        wall = [f"{r['median']:.3f} [{r['min']:.2f}-{r['max']:.2f}]" for r in row["ratios"].values()]
        cpu = [f"{r['median']:.3f}" for r in row["cpu_ratios"].values()]
        lines.append(f"{row['world_size']:>5}  {row['model']:<11} {_count(row['params']):>6} {row['tensors']:>7}  "
                     f"{ms['ddpkit']:>9.2f} {ms['torch']:>9.2f} {ms['bare']:>8.2f}  {wall[0]:<21} {wall[1]:<21} "
                     f"{cpu[0]:>7} {cpu[1]:>7}")
    for variant, what in (("inspected", "stall inspector"), ("timeline", "timeline")):
        found = [row for row in rows if f"{variant}/ddpkit" in row["ratios"]]
        if found:
            lines.append("")
            lines.append(f"{what} on vs off ({variant}/ddpkit: wall [min-max over rounds], cpu)")
        for row in found:
            wall, cpu = row["ratios"][f"{variant}/ddpkit"], row["cpu_ratios"][f"{variant}/ddpkit"]
            lines.append(f"{row['world_size']:>5}  {row['model']:<11} {wall['median']:.3f} "
                         f"[{wall['min']:.2f}-{wall['max']:.2f}]  cpu {cpu['median']:.3f}")
    return "\n".join(lines)


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k" if n >= 1e3 else str(n)


# -- the command line ----------------------------------------------------------------------------------------------
def run_benchmark(cfg: BenchConfig, progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Every world of `cfg`, measured and summarised: {"config", "environment", "results": [row, ...]}."""
    deadline = time.monotonic() + cfg.timeout_s
    rows = []
    for world_size in cfg.world_sizes:
        progress(f"world of {world_size}: starting {world_size} rank(s)")
        measured = run_world(world_size, cfg, deadline, progress)
        rows += [summarise(world_size, name, measured[name]) for name in cfg.models]
    return {"config": dataclasses.asdict(cfg), "environment": _environment(cfg), "results": rows}


def _environment(cfg: BenchConfig) -> dict[str, Any]:
    return {"torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "cpus": os.cpu_count(), "backend": "gloo", "threads_per_rank": cfg.threads}


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (a job scheduler, `kill`) stops the ranks the way Ctrl-C does, instead of orphaning them."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; Ctrl-C still works there
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None, prog: str = "python -m ddpkit.bench") -> int:
    """The command line; `prog` names it in --help (the CLI passes "ddpkit bench"). Returns the exit code."""
    defaults = BenchConfig()
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Per-step time of ddpkit's DDP vs torch's DDP vs the bare model, on CPU gloo ranks here.",
        epilog="Models: " + "; ".join(f"{n}: {w.about}" for n, w in WORKLOADS.items()))
    parser.add_argument("--world-size", type=int, default=defaults.world_size, help="ranks (default %(default)s)")
    parser.add_argument("--single", action=argparse.BooleanOptionalAction, default=defaults.single,
                        help="also measure a world of one, where ddpkit should cost nothing (default on)")
    parser.add_argument("--models", nargs="+", choices=list(WORKLOADS), default=list(defaults.models),
                        help="models to run (default: all)")
    parser.add_argument("--steps", type=int, default=defaults.steps,
                        help="timed steps per variant per round (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=defaults.warmup,
                        help="untimed steps per variant before the rounds (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=defaults.repeats,
                        help="rounds of interleaved variants (default %(default)s)")
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="bucket size for both wrappers, MiB (default: their own, 25)")
    parser.add_argument("--threads", type=int, default=defaults.threads,
                        help="torch threads per rank (default %(default)s)")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="model and data seed")
    parser.add_argument("--timeout", type=float, default=defaults.timeout_s,
                        help="deadline for the whole run, seconds (default %(default)s)")
    parser.add_argument("--json", metavar="PATH", help="also write every number (per step, per round) here")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--inspector", action="store_true",
                        help="also time ddpkit's DDP with the stall inspector on, against it off")
    parser.add_argument("--timeline", action="store_true", help="also time ddpkit's DDP recording a timeline")
    args = parser.parse_args(argv)
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        parser.error(f"--json {args.json}: its directory does not exist")  # before minutes of measuring, not after
    try:
        cfg = BenchConfig(world_size=args.world_size, single=args.single, models=tuple(dict.fromkeys(args.models)),
                          steps=args.steps, warmup=args.warmup, repeats=args.repeats,
                          bucket_cap_mb=args.bucket_cap_mb, threads=args.threads, seed=args.seed,
                          timeout_s=args.timeout, inspector=args.inspector, timeline=args.timeline)
    except ValueError as exc:
        parser.error(str(exc))
    progress = (lambda line: None) if args.quiet else (lambda line: print(f"[bench] {line}", file=sys.stderr,
                                                                          flush=True))
    try:
        with _terminate_as_interrupt():
            report = run_benchmark(cfg, progress)
    except BenchError as exc:
        print(f"ddpkit bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ddpkit bench: interrupted; every rank was stopped", file=sys.stderr)
        return 130
    env = report["environment"]
    print(f"ddpkit bench: torch {env['torch']}, gloo on loopback, {cfg.threads} thread(s) per rank, "
          f"{env['cpus']} CPUs; {cfg.steps} steps x {cfg.repeats} rounds per variant after {cfg.warmup} warm-up; "
          f"rank 0 medians")
    print(format_table(report["results"]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    # Run the imported ddpkit.bench, not this __main__ copy, so that the ranks unpickle the same functions.
    from ddpkit.bench import main as _main

    sys.exit(_main())
