"""`ddpkit launch`'s plan: torchrun's flags (parsed by torch.distributed.run's own parser, PET_* variables
included) resolved into one `LaunchPlan`; pure, unit-tested without processes.

    plan = plan_launch(torchrun_parser().parse_args(["--nproc-per-node", "2", "train.py"]))

The flags and their meanings are torchrun's, with ddpkit's few additions: one node by default rendezvouses on
a loopback-only store (torchrun binds every interface), --nproc-per-node's auto/cpu/gpu/xpu as torchrun has them,
OMP_NUM_THREADS shared among a node's workers, --timeline FILE [--timeline-steps A:B] (ddpkit.timeline; see
`add_ddpkit_flags`). torchrun's flags about its own output handling (--tee,
--redirects, ...) are refused with the reason, since ddpkit forwards every rank's output itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ddpkit.distributed.variables import TIMELINE_VAR
from ddpkit.timeline import spec as timeline_spec

# torchrun's defaults, so that the same flags mean the same job.
STATIC_DEFAULT_PORT = 29500
RDZV_TIMEOUT_S = 900
SHUTDOWN_TIMEOUT_S = 30  # torchrun's too, when neither the flag nor TORCH_ELASTIC_SHUTDOWN_TIMEOUT says

# torchrun's help where ddpkit gives a flag a meaning of its own.
HELP = {
    "standalone": "one node, rendezvous on a free loopback-only port (already the default on one node)",
    "log_dir": "also keep each rank's output in LOG_DIR/rank<R>.log (and rank<R>.restart<N>.log), with the "
               "error files; default: a temporary folder, removed at the end",
    "master_port": f"port of node 0's store (static rendezvous); default: a free loopback port on one node, "
                   f"{STATIC_DEFAULT_PORT} on several",
    "shutdown_timeout": "grace period, seconds: after forwarding a signal, wait this long for the workers before "
                        f"SIGKILL (default: TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else {SHUTDOWN_TIMEOUT_S})",
}
# torchrun's flags about how it shows or captures output (or runs workers) that ddpkit does its own way: each
# with the value that turns torchrun's feature off; set to anything else, it is refused with the reason.
_OUTPUT = "every rank's output already goes to the console, each line with its rank, and to one file per rank"
REFUSED = {
    "redirects": ("0", f"{_OUTPUT} (see --log-dir)"),
    "tee": ("0", f"{_OUTPUT} (see --log-dir)"),
    "local_ranks_filter": ("", _OUTPUT),
    "duplicate_stdout_filters": ([], f"{_OUTPUT}: keep the files with --log-dir and filter those"),
    "duplicate_stderr_filters": ([], f"{_OUTPUT}: keep the files with --log-dir and filter those"),
    "logs_specs": (None, _OUTPUT),
    "run_path": (False, "workers run as processes of their own (python, -m or --no-python)"),
    "event_log_handler": ("null", "ddpkit launch records no elastic events"),
    "numa_binding": (None, "ddpkit launch does not bind workers to NUMA nodes yet"),
    "virtual_local_rank": (False, "ddpkit launch gives every worker its own LOCAL_RANK"),
}


def torchrun_parser() -> argparse.ArgumentParser:
    """torchrun's own parser (torch.distributed.run's), its help changed where ddpkit gives a flag its own meaning;
    a parent for `ddpkit launch`'s parser. It reads PET_<FLAG> from os.environ into its defaults when built, as
    torchrun does, so build it in the environment the launch runs in."""
    from torch.distributed.run import get_args_parser  # torch is slow to import: only where flags are parsed

    parser = get_args_parser()
    for action in parser._actions:
        if action.dest in HELP:
            action.help = HELP[action.dest]
    return parser


def add_ddpkit_flags(parser: argparse.ArgumentParser) -> None:
    """ddpkit launch's flags beside torchrun's; like torchrun's, each may come from PET_<FLAG> instead."""
    from torch.distributed.argparse_util import env

    group = parser.add_argument_group("ddpkit")
    group.add_argument("--timeline", action=env, default=None, metavar="FILE",
                       help="record every rank's steps into this Chrome trace file and print where the time went")
    group.add_argument("--timeline-steps", "--timeline_steps", action=env, default=None, metavar="A:B",
                       help=f"optimizer steps A to B the timeline records (default: {timeline_spec.DEFAULT_STEPS})")


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """Everything one launcher needs, resolved from flags and environment; no process or port exists yet."""

    command: tuple[str, ...]  # what each worker runs, before the stderr-into-stdout wrapper
    nproc_per_node: int
    min_nodes: int
    max_nodes: int
    rdzv_backend: str  # "loopback" (one node, ours), static, c10d, etcd...
    rdzv_endpoint: str  # host:port; empty for loopback (the port is picked when the store binds)
    run_id: str
    rdzv_configs: dict[str, Any]
    max_restarts: int
    monitor_interval: float
    shutdown_timeout: float
    log_dir: str | None
    local_addr: str | None
    role: str
    start_method: str  # how torchelastic starts the workers (spawn, fork, forkserver)
    signals: str  # the signals forwarded to the workers, comma-separated names
    worker_env: dict[str, str]  # added to the launcher's environment, which every worker inherits

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be >= 1, got {self.nproc_per_node}")
        if not 0 < self.min_nodes <= self.max_nodes:
            raise ValueError(f"--nnodes needs 0 < MIN <= MAX, got {self.min_nodes}:{self.max_nodes}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}")
        if self.rdzv_backend == "static":
            if self.min_nodes != self.max_nodes:
                raise ValueError("the static rendezvous needs a fixed --nnodes; use --rdzv-backend c10d for MIN:MAX")
            if not 0 <= self.rdzv_configs["rank"] < self.max_nodes:
                raise ValueError(f"--node-rank {self.rdzv_configs['rank']} is outside 0..{self.max_nodes - 1}")


def cpu_cores() -> int:
    """The cores this process may run on (the affinity mask, which containers and SLURM narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def device_count(kind: str) -> int | None:
    """How many devices of `kind` this process sees, as torchrun counts them: "auto" torch.accelerator's (torch 2.6
    on; CUDA's before), "gpu" CUDA's, "xpu", or the name of torch's privateuse1 backend; None: no such kind."""
    import torch

    accelerator = getattr(torch, "accelerator", None)
    if kind == "auto" and accelerator is not None:
        return accelerator.device_count() if accelerator.is_available() else 0
    kind = "cuda" if kind in ("auto", "gpu") else kind
    if kind not in ("cuda", "xpu", torch._C._get_privateuse1_backend_name()):
        return None
    module = getattr(torch, kind, None)
    return module.device_count() if module is not None and module.is_available() else 0


def resolve_nproc(value: str, cores: int | None = None, count: Callable[[str], int | None] = device_count) -> int:
    """--nproc-per-node: a number, auto (the accelerator's devices if any, else CPU cores), cpu, or a kind of device
    (gpu: CUDA's, xpu, the privateuse1 backend's name), as torchrun has them. cores, count: for tests."""
    if value.isdigit():
        if int(value) < 1:
            raise ValueError(f"--nproc-per-node must be >= 1, got {value}")
        return int(value)
    cores = cpu_cores() if cores is None else cores
    if value == "cpu":
        return cores
    found = count(value)
    if value == "auto":
        return found or cores
    if found is None:
        raise ValueError(f"--nproc-per-node must be a number, auto, cpu, gpu or a device kind (xpu, ...); got "
                         f"{value!r}")
    if not found:
        raise ValueError(f"--nproc-per-node {value}: no {value} device is visible")
    return found


def parse_nnodes(value: str) -> tuple[int, int]:
    parts = value.split(":")
    if len(parts) not in (1, 2) or not all(part.strip().isdigit() for part in parts):
        raise ValueError(f"--nnodes must be N or MIN:MAX (whole numbers, as 2 or 1:4), got {value!r}")
    low, high = int(parts[0]), int(parts[-1])
    if not 0 < low <= high:  # before a MAX of 1 makes the launch a single node's, whatever MIN said
        raise ValueError(f"--nnodes needs 0 < MIN <= MAX, got {value!r}")
    return low, high


def parse_rdzv_conf(value: str) -> dict[str, Any]:
    conf: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--rdzv-conf wants key=value pairs separated by commas, got {item!r}")
        conf[key.strip()] = val.strip()
    return conf


def worker_command(script: str, script_args: Sequence[str], module: bool, no_python: bool,
                   python: str | None = None) -> tuple[str, ...]:
    if no_python:
        if module:
            raise ValueError("--module and --no-python exclude each other")
        return (script, *script_args)
    # -u: unbuffered, so that lines reach the launcher (and a crash loses none) as they are printed
    return (python or sys.executable, "-u", *(("-m",) if module else ()), script, *script_args)


def worker_env_additions(nproc_per_node: int, loopback: bool, environ: Mapping[str, str],
                         cores: int | None = None) -> dict[str, str]:
    """What the launcher adds to its workers' environment, never overriding what the user set."""
    added = {}
    if "OMP_NUM_THREADS" not in environ:
        # the node's cores shared among its workers, so that N workers do not each start `cores` threads
        added["OMP_NUM_THREADS"] = str(max(1, (cpu_cores() if cores is None else cores) // nproc_per_node))
    if loopback and "GLOO_SOCKET_IFNAME" not in environ and _loopback_interface():
        # gloo listens on the address its host name resolves to; on one node, keep it on loopback too
        added["GLOO_SOCKET_IFNAME"] = _loopback_interface()
    return added


def _loopback_interface() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return "lo" if "lo" in names else None


def timeline_env(args: argparse.Namespace) -> dict[str, str]:
    """DDPKIT_TIMELINE for the workers (read back by ddpkit.timeline.spec.request) when --timeline asks."""
    # getattr: a namespace from torchrun's parser alone (without add_ddpkit_flags) plans a run without one.
    path, steps = getattr(args, "timeline", None), getattr(args, "timeline_steps", None)
    if not path:
        if steps:
            raise ValueError("--timeline-steps needs --timeline FILE, the trace to write")
        return {}
    return {TIMELINE_VAR: timeline_spec.encode(path, steps)}


def _refuse_unsupported(args: argparse.Namespace) -> None:
    for dest, (off, why) in REFUSED.items():
        if getattr(args, dest, off) != off:
            flag = "--" + dest.replace("_", "-")
            raise ValueError(f"{flag} is torchrun's and not ddpkit launch's: {why}")


def plan_launch(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> LaunchPlan:
    """Resolve torchrun's flags (parsed by `torchrun_parser`) into a plan, with torchrun's meanings."""
    env = os.environ if environ is None else environ
    _refuse_unsupported(args)
    min_nodes, max_nodes = parse_nnodes(str(args.nnodes))
    nproc = resolve_nproc(str(args.nproc_per_node))
    backend, endpoint, run_id = args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id
    configs = parse_rdzv_conf(args.rdzv_conf)
    # One node and no address given: torchrun binds a c10d store on all interfaces; we bind loopback only.
    loopback = args.standalone or (backend == "static" and not endpoint and args.master_port is None
                                   and max_nodes == 1)
    if loopback:
        backend, endpoint, run_id = "loopback", "", uuid.uuid4().hex
        min_nodes = max_nodes = 1
        configs["rank"] = 0
    elif backend == "static":
        endpoint = endpoint or f"{args.master_addr}:{args.master_port or STATIC_DEFAULT_PORT}"
        configs["rank"] = args.node_rank
        if run_id == "none" and max_nodes == 1:  # one node agrees with itself: a launch id of its own, which its
            run_id = uuid.uuid4().hex  # workers read as TORCHELASTIC_RUN_ID (a restart knows its own run by it)
    configs.setdefault("timeout", RDZV_TIMEOUT_S)
    shutdown = args.shutdown_timeout
    if shutdown is None:
        shutdown = int(env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", SHUTDOWN_TIMEOUT_S))
    return LaunchPlan(
        command=worker_command(args.training_script, args.training_script_args, args.module, args.no_python,
                               env.get("PYTHON_EXEC")),
        nproc_per_node=nproc, min_nodes=min_nodes, max_nodes=max_nodes, rdzv_backend=backend,
        rdzv_endpoint=endpoint, run_id=run_id, rdzv_configs=configs, max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval, shutdown_timeout=float(shutdown), log_dir=args.log_dir,
        local_addr=args.local_addr, role=args.role, start_method=args.start_method,
        signals=args.signals_to_handle, worker_env={**worker_env_additions(nproc, loopback, env), **timeline_env(args)},
    )


__all__ = ["LaunchPlan", "add_ddpkit_flags", "cpu_cores", "parse_nnodes", "parse_rdzv_conf", "plan_launch",
           "device_count", "resolve_nproc", "timeline_env", "torchrun_parser", "worker_command", "worker_env_additions"]
