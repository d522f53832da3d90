"""Step time of ddpkit's DistributedDataParallel against torch's and against the bare model, on this machine.

    python -m ddpkit.bench                                   # 2 gloo ranks, then a world of one; ~1 min, 2 cores
    python -m ddpkit.bench --models many-small --repeats 30  # one model, more rounds for a tighter spread
    python -m ddpkit.bench --world-size 4 --threads 1 --json bench.json
    ddpkit bench --world-size 2                              # the same through the CLI
    ddpkit bench --compile --models mlp transformer          # every variant under torch.compile (inductor)
    ddpkit bench --zero                                      # ZeRO stages vs torch's DDP, ZeRO and FSDP2: bench_zero

Each world is a fresh set of CPU processes joined over gloo on loopback. On every rank, each model is built
three times from the same seed: wrapped in ddpkit's DDP, wrapped in torch's DDP, and bare (no wrapper, no
communication). A step is zero_grad, forward, backward and an SGD step, timed with time.perf_counter (CPU ops
are synchronous, and both wrappers wait for their all-reduces before backward returns). After a warm-up, the
variants run in rounds of `--steps` steps each, interleaved and with their order rotated every round, so that
a noisy machine slows all three alike; a barrier lines the ranks up before every timed block.

Rank 0's numbers are reported: each variant's median step time over all rounds, and each ratio as the median
of the per-round ratios [min-max]. The `cpu` columns are the same ratios of process CPU time, which leaves out
time spent descheduled and so moves less when other jobs share the cores (but also leaves out waiting for the
other ranks). In a world of one ddpkit's wrapper does no work, so ddpkit/bare there should be level
(within the noise, about 5%).
With --compile every variant is torch.compile'd (the wrapper, not the module inside it), and both wrappers let
Dynamo's DDPOptimizer split the graph at their bucket boundaries.

The parts: bench_workloads (the models), bench_rank (one rank's measuring), bench_report (the summary);
this module holds the configuration, the parent that runs each world (bench_zero's too), and the command line.
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
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.distributed.elastic.utils.distributed import get_free_port

from ddpkit._utils.atomic import replacing
from ddpkit.bench.rank import VARIANTS, rank_main, round_order, variants_of  # noqa: F401 - the benchmark's API
from ddpkit.bench.report import RATIOS, format_table, ratio_stats, summarise  # noqa: F401
from ddpkit.bench.workloads import WORKLOADS

SEED_LIMIT = 2**53  # so that a rank's data seed, 1000 * seed + rank, stays below torch's limit (2**64)


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
    timeline: bool = False  # add "timeline": ddpkit's DDP recording a timeline of every step (ddpkit.timeline)
    compile: str | None = None  # a torch.compile backend applied to every variant (compile(wrapper)); None: eager

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
        if not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed must be an integer in [0, {SEED_LIMIT}), got {self.seed}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout must be positive, got {self.timeout_s} s")
        if self.compile is not None:
            backends = torch._dynamo.list_backends(exclude_tags=())
            if self.compile not in backends:
                raise ValueError(f"unknown torch.compile backend {self.compile!r}; choose from {', '.join(backends)}")
            if self.warmup < 1:
                raise ValueError("--compile needs at least one warm-up step: the first step compiles")

    @property
    def world_sizes(self) -> list[int]:
        return [self.world_size] + ([1] if self.single and self.world_size != 1 else [])


# -- the parent: spawn one world, collect the ranks' numbers, never leave a process behind (bench_zero's too) -----
class BenchError(RuntimeError):
    """A rank failed, died or missed the deadline; every rank of that world has been stopped."""


def run_world(world_size: int, cfg: BenchConfig, deadline: float,
              progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Rank 0's measurements for every model in a fresh world of `world_size` ranks (deadline: time.monotonic)."""
    hint = f"{cfg.timeout_s:.0f} s for the whole run; raise it with --timeout"
    return run_ranks(rank_main, world_size, (cfg,), deadline, hint, progress)[0]


def run_ranks(target: Callable[..., None], world_size: int, args: tuple, deadline: float, hint: str,
              progress: Callable[[str], None] = lambda line: None) -> dict[int, Any]:
    """Every rank's payload, by rank, from a fresh world of `world_size` spawned processes, each running
    target(rank, world_size, port, *args, results). A rank puts ("progress", rank, line), ("error", rank, text)
    or, once, ("ok", rank, payload) on `results`. Whatever ends the call (the last payload, a rank's error or death,
    the deadline, or Ctrl-C or SIGTERM as KeyboardInterrupt), no rank outlives it. `hint`: what the deadline was."""
    ctx = mp.get_context("spawn")  # fresh interpreters: no thread pools or locks inherited from the caller
    results = ctx.Queue()
    port = get_free_port()
    procs = [ctx.Process(target=target, args=(rank, world_size, port, *args, results), daemon=True,
                         name=f"ddpkit-bench-rank{rank}") for rank in range(world_size)]
    done: dict[int, Any] = {}
    try:
        with _ranks_start_deaf_to_ctrl_c():
            for proc in procs:
                proc.start()
        _collect(procs, results, done, deadline, hint, progress)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.join(timeout=5 if len(done) == world_size else 0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        results.close()
        results.cancel_join_thread()  # nobody is left to read; never block on a full pipe
    return done


def _collect(procs: list, results, done: dict[int, Any], deadline: float, hint: str,
             progress: Callable[[str], None]) -> None:
    """Read the ranks' messages into `done` until every rank has sent its payload; raise BenchError otherwise."""
    world_size = len(procs)
    while len(done) < world_size:
        left = deadline - time.monotonic()
        if left <= 0:
            missing = sorted(set(range(world_size)) - set(done))
            raise BenchError(f"world of {world_size}: ranks {missing} had not finished at the deadline ({hint})")
        try:
            kind, rank, payload = results.get(timeout=min(left, 0.5))
        except queue.Empty:
            dead = {r: p.exitcode for r, p in enumerate(procs) if r not in done and p.exitcode is not None}
            if not dead:
                continue
            try:  # its last message may still be in the pipe
                kind, rank, payload = results.get(timeout=1.0)
            except queue.Empty:
                raise BenchError(f"world of {world_size}: ranks died without a word (exit codes {dead})") from None
        if kind == "progress":
            progress(payload)
        elif kind == "error":
            raise BenchError(f"world of {world_size}: rank {rank} failed:\n{payload}")
        else:
            done[rank] = payload


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
            "cpus": os.cpu_count(), "backend": "gloo", "threads_per_rank": cfg.threads, "compile": cfg.compile}


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


@contextlib.contextmanager
def _ranks_start_deaf_to_ctrl_c() -> Iterator[None]:
    """Ctrl-C ignored while the ranks are started: an ignored signal stays ignored through exec, so a rank is deaf
    to the terminal's Ctrl-C from its first instruction, not only once its main has run (a Ctrl-C while it was
    still importing printed its KeyboardInterrupt traceback). The parent ignores it only for the few milliseconds
    the starts take; it stops the ranks itself."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def run_interruptible(label: str, work: Callable[[], Any]) -> tuple[Any, int]:
    """(work(), 0), or (None, exit code) with one line on stderr when a world failed (1) or Ctrl-C or SIGTERM
    stopped it (130, as a shell reports SIGINT); in every case no rank is left running (run_ranks sees to it)."""
    try:
        with _terminate_as_interrupt():
            return work(), 0
    except BenchError as exc:
        print(f"{label}: {exc}", file=sys.stderr)
        return None, 1
    except KeyboardInterrupt:
        print(f"{label}: interrupted; every rank was stopped", file=sys.stderr)
        return None, 130


def bounded(kind: type, low: float, strict: bool = False) -> Callable[[str], Any]:
    """An argparse `type` for a finite `kind` >= low (> low if `strict`): a value out of range stops the command
    before any rank starts, with the usage line, the option's name, the allowed range and exit code 2."""
    allowed = f"{'an integer' if kind is int else 'a finite number'} {'>' if strict else '>='} {low}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or (kind is float and not math.isfinite(value)) or value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        return value

    parse.__name__ = kind.__name__
    return parse


def check_json_path(parser: argparse.ArgumentParser, path: str | None) -> None:
    """--json's folder must exist: said before minutes of measuring, not after."""
    if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        parser.error(f"--json {path}: its directory does not exist")


def _parser(prog: str) -> argparse.ArgumentParser:
    from ddpkit.bench.zero import SUMMARY as ZERO_SUMMARY

    defaults = BenchConfig()
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Per-step time of ddpkit's DDP vs torch's DDP vs the bare model, on CPU gloo ranks here "
                    "(or, with --zero, of ddpkit's ZeRO stages against torch's).",
        epilog="Models: " + "; ".join(f"{n}: {w.about}" for n, w in WORKLOADS.items()))
    parser.add_argument("--zero", action="store_true",
                        help=f"run the ZeRO comparison instead. {ZERO_SUMMARY} Its options and defaults differ: "
                             "see `%(prog)s --zero --help`")
    parser.add_argument("--world-size", type=bounded(int, 1), default=defaults.world_size,
                        help="ranks (default %(default)s)")
    parser.add_argument("--single", action=argparse.BooleanOptionalAction, default=defaults.single,
                        help="also measure a world of one, where ddpkit should cost nothing (default on)")
    parser.add_argument("--models", nargs="+", choices=list(WORKLOADS), default=list(defaults.models),
                        help="models to run (default: all)")
    parser.add_argument("--steps", type=bounded(int, 1), default=defaults.steps,
                        help="timed steps per variant per round (default %(default)s)")
    parser.add_argument("--warmup", type=bounded(int, 0), default=defaults.warmup,
                        help="untimed steps per variant before the rounds (default %(default)s)")
    parser.add_argument("--repeats", type=bounded(int, 1), default=defaults.repeats,
                        help="rounds of interleaved variants (default %(default)s)")
    parser.add_argument("--bucket-cap-mb", type=bounded(float, 0, strict=True), default=None,
                        help="bucket size for both wrappers, MiB (default: their own, 25)")
    parser.add_argument("--threads", type=bounded(int, 1), default=defaults.threads,
                        help="torch threads per rank (default %(default)s)")
    parser.add_argument("--seed", type=bounded(int, 0), default=defaults.seed,
                        help=f"model and data seed, below {SEED_LIMIT} (default %(default)s)")
    parser.add_argument("--timeout", type=bounded(float, 0, strict=True), default=defaults.timeout_s,
                        help="deadline for the whole run, seconds (default %(default)s)")
    parser.add_argument("--json", metavar="PATH", help="also write every number (per step, per round) here")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--inspector", action="store_true",
                        help="also time ddpkit's DDP with the stall inspector on, against it off")
    parser.add_argument("--timeline", action="store_true", help="also time ddpkit's DDP recording a timeline")
    parser.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                        help="torch.compile every variant (the wrapper: compile(DDP(model))) with BACKEND "
                             "(default inductor; aot_eager compiles much faster); warm-up steps include compiling")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "python -m ddpkit.bench") -> int:
    """The command line; `prog` names it in --help (the CLI passes "ddpkit bench"). Returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(arg.startswith("--z") and "--zero".startswith(arg) for arg in argv):  # --zero, or argparse's --ze
        from ddpkit.bench.zero import main as zero_main  # the ZeRO comparison: its own module and options

        return zero_main(argv, prog=f"{prog} --zero")
    parser = _parser(prog)
    args = parser.parse_args(argv)
    check_json_path(parser, args.json)
    try:
        cfg = BenchConfig(world_size=args.world_size, single=args.single, models=tuple(dict.fromkeys(args.models)),
                          steps=args.steps, warmup=args.warmup, repeats=args.repeats,
                          bucket_cap_mb=args.bucket_cap_mb, threads=args.threads, seed=args.seed,
                          timeout_s=args.timeout, inspector=args.inspector, timeline=args.timeline,
                          compile=args.compile)
    except ValueError as exc:
        parser.error(str(exc))
    progress = (lambda line: None) if args.quiet else (lambda line: print(f"[bench] {line}", file=sys.stderr,
                                                                          flush=True))
    report, code = run_interruptible("ddpkit bench", lambda: run_benchmark(cfg, progress))
    if code:
        return code
    env = report["environment"]
    print(f"ddpkit bench: torch {env['torch']}, gloo on loopback, {cfg.threads} thread(s) per rank, "
          f"{env['cpus']} CPUs; {'compiled (' + cfg.compile + '), ' if cfg.compile else ''}"
          f"{cfg.steps} steps x {cfg.repeats} rounds per variant after {cfg.warmup} warm-up; rank 0 medians")
    print(format_table(report["results"]))
    if args.json:
        with replacing(args.json) as fh:
            json.dump(report, fh, indent=1)
    return 0

