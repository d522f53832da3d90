"""`ddpkit launch`: start the workers of a data-parallel job, on torch.distributed.elastic (torchrun's engine).

    ddpkit launch --nproc-per-node 2 train.py --lr 3e-4      # one node, 2 workers, store on loopback only
    ddpkit launch --nproc-per-node auto -m mypkg.train        # one worker per GPU, else per CPU core
    # two nodes, static rendezvous: run on each node, with its own --node-rank
    ddpkit launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 --nproc-per-node 4 train.py
    # two nodes, elastic c10d rendezvous: the same line on every node
    ddpkit launch --nnodes 2 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29400 --rdzv-id job7 train.py

Flags, their PET_* variables and the workers' environment (RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK, ROLE_*,
MASTER_ADDR/PORT, TORCHELASTIC_*) are torchrun's. Starting, rendezvous, restarts and error files are
torchelastic's own; ddpkit adds, in this order below:
  1. the plan: flags resolved into one `LaunchPlan` (pure; unit-tested without processes);
  2. a single node by default, its store on a free loopback port, a fresh one for every restart
     (`_loopback_rendezvous`);
  3. output: each worker's stdout and stderr merged into one file per rank, tailed live with a rank prefix;
  4. the summary: the root cause first, with its traceback (recorded by `ddpkit.errors` in the worker), the
     signal that killed a worker by name, and the tail of its output when no traceback was recorded.
Signals: SIGINT, SIGTERM, SIGHUP and SIGQUIT sent to the launcher are forwarded to every worker, which then
has --shutdown-timeout seconds to exit before SIGKILL. When a worker fails, torchelastic sends SIGTERM to the
others at once (and SIGKILL after its own fixed 30 s).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import socket
import sys
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Callable

# torch (and torchelastic) are imported inside the functions that start processes, so that `ddpkit --help`
# and the plan's unit tests stay fast.

# The prefix on every console line of a worker; ${rank} is the global rank.
LINE_PREFIX_TEMPLATE = "[rank${rank}]: "
SIGNALS_FORWARDED = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
# Lines of a failed worker's output shown when it left no traceback (killed, os._exit, failed before ddpkit).
OUTPUT_TAIL_LINES = 20
# torchrun's defaults, so that the same flags mean the same job.
STATIC_DEFAULT_PORT = 29500
RDZV_TIMEOUT_S = 900


@dataclasses.dataclass(frozen=True)
class Option:
    """One flag of `ddpkit launch`; `PET_<DEST>` in the environment stands in for it, as under torchrun."""

    flags: tuple[str, ...]
    help: str
    default: Any = None
    type: Callable[[str], Any] | None = str
    switch: bool = False  # a flag without a value (PET_<DEST>=1 turns it on)

    @property
    def dest(self) -> str:
        return max(self.flags, key=len).lstrip("-").replace("-", "_")  # torchrun's rule: the longest flag


OPTIONS = (
    Option(("--nproc-per-node", "--nproc_per_node"),
           "workers on this node: a number, or auto (one per GPU if any, else one per CPU core), gpu, cpu", "1"),
    Option(("--nnodes",), "nodes in the job: N, or MIN:MAX for an elastic (c10d) job", "1"),
    Option(("--node-rank", "--node_rank"), "this node's rank, 0..nnodes-1 (static rendezvous only)", 0, int),
    Option(("--master-addr", "--master_addr"), "address of node 0 (static rendezvous)", "127.0.0.1"),
    Option(("--master-port", "--master_port"),
           f"port of node 0's store (static rendezvous); default: a free loopback port on one node, "
           f"{STATIC_DEFAULT_PORT} on several", None, int),
    Option(("--rdzv-backend", "--rdzv_backend"), "rendezvous backend: static, c10d or etcd", "static"),
    Option(("--rdzv-endpoint", "--rdzv_endpoint"), "rendezvous endpoint, host:port", ""),
    Option(("--rdzv-id", "--rdzv_id"), "job id, the same on every node (c10d/etcd)", "none"),
    Option(("--rdzv-conf", "--rdzv_conf"), "more rendezvous settings: key=value,key=value", ""),
    Option(("--standalone",), "one node, rendezvous on a free loopback port (the default for one node)",
           switch=True),
    Option(("--max-restarts", "--max_restarts"), "restarts of the whole worker group after a failure", 0, int),
    Option(("--monitor-interval", "--monitor_interval"), "seconds between checks of the workers", 0.1, float),
    Option(("--shutdown-timeout", "--shutdown_timeout"),
           "grace period, seconds: after forwarding a signal, wait this long for the workers before SIGKILL",
           30.0, float),
    Option(("--log-dir", "--log_dir"), "also write each rank's output to LOG_DIR/rank<R>.log", None),
    Option(("--local-addr", "--local_addr"), "this node's address as other nodes reach it (default: its FQDN)"),
    Option(("--role",), "role name of the workers (ROLE_NAME)", "default"),
    Option(("-m", "--module"), "run the script as a module, as `python -m`", switch=True),
    Option(("--no-python", "--no_python"), "run the script as a program, without python", switch=True),
    Option(("--timeline",), "record every rank's steps into this Chrome trace file and print where the time went"),
    Option(("--timeline-steps", "--timeline_steps"), "optimizer steps A:B the timeline records (default: 3:8)"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `ddpkit launch`, generated from OPTIONS; values left unset resolve in `plan_launch`."""
    for opt in OPTIONS:
        if opt.switch:
            parser.add_argument(*opt.flags, dest=opt.dest, action="store_const", const=True, default=None,
                                help=f"{opt.help} [PET_{opt.dest.upper()}]")
        else:
            parser.add_argument(*opt.flags, dest=opt.dest, type=opt.type, default=None,
                                help=f"{opt.help}{'' if opt.default in (None, '') else f' (default: {opt.default})'}"
                                     f" [PET_{opt.dest.upper()}]")
    parser.add_argument("script", help="the training script (a module with -m, a program with --no-python)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")


def _option_values(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, Any]:
    """Each option from the command line, else PET_<DEST>, else its default."""
    values = {}
    for opt in OPTIONS:
        value = getattr(args, opt.dest, None)
        env_value = environ.get(f"PET_{opt.dest.upper()}")
        if value is None and env_value not in (None, ""):
            if opt.switch:
                value = env_value.strip().lower() not in ("0", "false", "no")
            else:
                value = opt.type(env_value) if opt.type else env_value
        values[opt.dest] = opt.default if value is None else value
    return values


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


def resolve_nproc(value: str, gpus: int | None = None, cores: int | None = None) -> int:
    """--nproc-per-node: a number, or auto (GPUs if any, else CPU cores), gpu or cpu."""
    if value.isdigit():
        if int(value) < 1:
            raise ValueError(f"--nproc-per-node must be >= 1, got {value}")
        return int(value)
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cores = cpu_cores() if cores is None else cores
    if value == "auto":
        return gpus or cores
    if value == "gpu":
        if not gpus:
            raise ValueError("--nproc-per-node gpu: no GPU is visible")
        return gpus
    if value == "cpu":
        return cores
    raise ValueError(f"--nproc-per-node must be a number, auto, gpu or cpu; got {value!r}")


def parse_nnodes(value: str) -> tuple[int, int]:
    parts = value.split(":")
    if len(parts) == 1:
        return int(parts[0]), int(parts[0])
    if len(parts) == 2:
        return int(parts[0]), int(parts[1])
    raise ValueError(f"--nnodes must be N or MIN:MAX, got {value!r}")


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


def plan_launch(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> LaunchPlan:
    """Resolve `ddpkit launch`'s flags and PET_* variables into a plan, with torchrun's meanings."""
    env = os.environ if environ is None else environ
    opts = _option_values(args, env)
    min_nodes, max_nodes = parse_nnodes(str(opts["nnodes"]))
    nproc = resolve_nproc(str(opts["nproc_per_node"]))
    backend, endpoint, run_id = opts["rdzv_backend"], opts["rdzv_endpoint"], opts["rdzv_id"]
    configs = parse_rdzv_conf(opts["rdzv_conf"])
    # One node and no address given: torchrun binds a c10d store on all interfaces; we bind loopback only.
    loopback = opts["standalone"] or (backend == "static" and not endpoint and opts["master_port"] is None
                                      and max_nodes == 1)
    if loopback:
        backend, endpoint, run_id = "loopback", "", uuid.uuid4().hex
        min_nodes = max_nodes = 1
        configs["rank"] = 0
    elif backend == "static":
        endpoint = endpoint or f"{opts['master_addr']}:{opts['master_port'] or STATIC_DEFAULT_PORT}"
        configs["rank"] = opts["node_rank"]
    configs.setdefault("timeout", RDZV_TIMEOUT_S)
    return LaunchPlan(
        command=worker_command(args.script, args.script_args, opts["module"], opts["no_python"],
                               env.get("PYTHON_EXEC")),
        nproc_per_node=nproc,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        run_id=run_id,
        rdzv_configs=configs,
        max_restarts=opts["max_restarts"],
        monitor_interval=opts["monitor_interval"],
        shutdown_timeout=opts["shutdown_timeout"],
        log_dir=opts["log_dir"],
        local_addr=opts["local_addr"],
        role=opts["role"],
        worker_env={**worker_env_additions(nproc, loopback, env), **_timeline_env(opts)},
    )


def _timeline_env(opts: Mapping[str, Any]) -> dict[str, str]:
    """DDPKIT_TIMELINE for the workers (read back by ddpkit.env.timeline_request) when --timeline asks."""
    from .timeline_spec import ENV_VAR, encode

    if not opts["timeline"]:
        if opts["timeline_steps"]:
            raise ValueError("--timeline-steps needs --timeline FILE, the trace to write")
        return {}
    return {ENV_VAR: encode(opts["timeline"], opts["timeline_steps"])}


# ---------------------------------------------------------------------------------------------------------
# Starting the job (torchelastic from here on)
# ---------------------------------------------------------------------------------------------------------


def _loopback_rendezvous(run_id: str, timeout_s: float):
    """torchelastic's static rendezvous for one node, its store listening on 127.0.0.1 only.

    TCPStore binds every interface when it opens its own socket; given a socket we bound to loopback
    (master_listen_fd) it serves on that one instead. Each attempt gets a fresh store on a fresh port, as torch
    intends ("we create a new TCPStore for every retry", torch/distributed/rendezvous.py): no key of a failed
    attempt (gloo's peer addresses, join counters, posted failures) can mislead the restarted workers.
    """
    import datetime

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    class LoopbackRendezvous(StaticTCPRendezvous):
        def __init__(self):
            super().__init__("127.0.0.1", 0, rank=0, world_size=1, run_id=run_id, timeout=int(timeout_s))
            self._servers: list[tuple[socket.socket, dist.TCPStore]] = []  # every attempt's, closed at the end

        def next_rendezvous(self) -> RendezvousInfo:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.bind(("127.0.0.1", 0))
            listener.listen(128)
            self.master_port = listener.getsockname()[1]
            store = dist.TCPStore("127.0.0.1", self.master_port, 1, True, datetime.timedelta(seconds=timeout_s),
                                  multi_tenant=True, master_listen_fd=listener.fileno())
            self._servers.append((listener, store))
            return RendezvousInfo(dist.PrefixStore(run_id, store), 0, 1,
                                  RendezvousStoreInfo("127.0.0.1", self.master_port))

        def shutdown(self) -> bool:
            for listener, _ in self._servers:
                listener.close()
            self._servers.clear()
            return True

    return LoopbackRendezvous()


def _rendezvous_handler(plan: LaunchPlan):
    from torch.distributed.elastic.rendezvous import RendezvousParameters, registry

    if plan.rdzv_backend == "loopback":
        return _loopback_rendezvous(plan.run_id, float(plan.rdzv_configs["timeout"]))
    params = RendezvousParameters(backend=plan.rdzv_backend, endpoint=plan.rdzv_endpoint, run_id=plan.run_id,
                                  min_nodes=plan.min_nodes, max_nodes=plan.max_nodes,
                                  local_addr=plan.local_addr, **plan.rdzv_configs)
    return registry.get_rendezvous_handler(params)


def _rank_logs(log_dir: str | None):
    """torchelastic LogsSpecs: per rank, one file with stdout and stderr, tailed to the console; error files."""
    from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

    class RankLogs(LogsSpecs):
        def __init__(self):
            self.owned = log_dir is None  # a temporary directory, removed with `cleanup`
            root = tempfile.mkdtemp(prefix="ddpkit-launch-") if self.owned else os.path.abspath(log_dir)
            os.makedirs(root, exist_ok=True)
            super().__init__(log_dir=root)
            self.files: dict[int, str] = {}  # global rank -> output file of the latest attempt

        @property
        def root_log_dir(self) -> str:
            return str(self._root_log_dir)

        def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
            dest = LogsDest()
            for local_rank, env in envs.items():
                rank, attempt = int(env["RANK"]), int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
                stem = os.path.join(self.root_log_dir, f"rank{rank}" + (f".restart{attempt}" if attempt else ""))
                error_file = stem + ".error.json"
                if os.path.exists(error_file):  # from an earlier run in the same --log-dir: not ours
                    os.remove(error_file)
                env["TORCHELASTIC_ERROR_FILE"] = error_file
                dest.stdouts[local_rank] = dest.tee_stdouts[local_rank] = stem + ".log"
                dest.stderrs[local_rank] = ""  # merged into stdout by the worker's wrapper
                dest.error_files[local_rank] = error_file
                self.files[rank] = stem + ".log"
            return dest

        def cleanup(self) -> None:
            if self.owned:
                shutil.rmtree(self.root_log_dir, ignore_errors=True)

    return RankLogs()


# `sh -c 'exec "$@" 2>&1'`: the worker's stderr joins its stdout, so one file per rank keeps both in order; exec
# leaves the worker's pid, signals and exit status as they would be without the wrapper.
MERGE_STDERR = ("/bin/sh", "-c", 'exec "$@" 2>&1', "ddpkit-worker")


def run(plan: LaunchPlan) -> int:
    """Run the job; the exit status: 0, 1 when a worker failed, 128+N when the launcher got signal N."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import SignalException

    # Workers inherit the launcher's environment (torchelastic copies os.environ into each); the process
    # context reads the signals to forward from here.
    os.environ.update(plan.worker_env)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = SIGNALS_FORWARDED
    logs = _rank_logs(plan.log_dir)
    handler = None
    shutdown_rdzv = True
    try:
        handler = _rendezvous_handler(plan)
        master_addr = master_port = None
        if plan.rdzv_backend == "static":  # otherwise the rendezvous says, per attempt
            master_addr, master_port = handler.master_addr, handler.master_port
        spec = WorkerSpec(role=plan.role, local_world_size=plan.nproc_per_node, entrypoint=MERGE_STDERR[0],
                          args=(*MERGE_STDERR[1:], *plan.command), rdzv_handler=handler,
                          max_restarts=plan.max_restarts, monitor_interval=plan.monitor_interval,
                          master_addr=master_addr, master_port=master_port, local_addr=plan.local_addr)
        agent = LocalElasticAgent(spec, logs_specs=logs, start_method="spawn",
                                  log_line_prefix_template=LINE_PREFIX_TEMPLATE,
                                  shutdown_timeout=plan.shutdown_timeout)
        result = agent.run()
        if result is not None and result.is_failed():
            print(failure_summary(result.failures, logs.files, logs.root_log_dir if not logs.owned else None),
                  file=sys.stderr, flush=True)
            return 1
        return 0
    except SignalException as exc:
        # torchelastic has already forwarded the signal and waited out the grace period. Leave the
        # rendezvous of a multi-node job open: its other nodes may still re-form it.
        shutdown_rdzv = plan.rdzv_backend == "loopback"
        print(f"ddpkit launch: stopped by {exc.sigval.name}; the workers were sent {exc.sigval.name}",
              file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    finally:
        if handler is not None and shutdown_rdzv:
            handler.shutdown()
        logs.cleanup()


def _signal_name(exitcode: int) -> str:
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _describe(failure) -> str:
    if failure.exitcode < 0:
        return f"killed by {_signal_name(failure.exitcode)} (signal {-failure.exitcode})"
    return f"exited with code {failure.exitcode}"


def _traceback(failure) -> str | None:
    # torchelastic fills in {"message": "<NONE>"} for a worker that left no error file: that is no traceback.
    if not os.path.isfile(getattr(failure, "error_file", "") or ""):
        return None
    message = failure.error_file_data.get("message") if isinstance(failure.error_file_data, dict) else None
    if isinstance(message, dict):
        message = message.get("extraInfo", {}).get("py_callstack") or message.get("message")
    return None if message in (None, "", "<NONE>") else message


# Words of an error raised because another rank had died first: a consequence, never the root cause.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "PeerFailedError", "Broken pipe",
              "remote process exited", "ProcessGroupNCCL is aborted")


def root_cause(failures: Mapping[int, Any]) -> int:
    """The global rank whose failure caused the others.

    A recorded traceback beats everything (the others were stopped because of it), the earliest written first,
    unless it only says that a peer was gone; then a worker that died on its own (an exit code, or a signal
    other than the SIGTERM/SIGKILL the agent sends to the survivors); then a killed one. torchelastic's own choice, the earliest timestamp, counts whole seconds, so it
    often names a survivor that was merely stopped, or one that raised only because its peer had died; the
    error file's modification time orders them to the nanosecond.
    """
    def key(rank):
        failure = failures[rank]
        trace = _traceback(failure)
        stopped_by_agent = failure.exitcode in (-signal.SIGTERM, -signal.SIGKILL)
        try:
            when = os.stat(failure.error_file).st_mtime_ns / 1e9
        except (OSError, TypeError):
            when = float(failure.timestamp)
        if trace is not None and not any(marker in trace for marker in _PEER_GONE):
            tier = 0  # raised on its own
        elif trace is None and not stopped_by_agent:
            tier = 1  # died on its own: an exit code, or a signal the agent does not send
        elif trace is None:
            tier = 2  # killed: by the agent, or by itself
        else:
            tier = 3  # raised only because a peer had already gone
        return (tier, when, rank)

    return min(failures, key=key)


def _tail(path: str | None, lines: int = OUTPUT_TAIL_LINES) -> str:
    if not path or not os.path.exists(path):
        return ""
    with open(path, errors="replace") as fp:
        return "".join(fp.readlines()[-lines:])


def failure_summary(failures: Mapping[int, Any], output_files: Mapping[int, str] | None = None,
                    log_dir: str | None = None) -> str:
    """The launcher's report on a failed job: the root cause first, then every other failed rank."""
    output_files = output_files or {}
    first = root_cause(failures)
    failure = failures[first]
    lines = ["=" * 80, "ddpkit launch: the job failed",
             f"root cause: rank {first} (local rank {failure.local_rank}, pid {failure.pid}) {_describe(failure)}"]
    trace = _traceback(failure)
    if trace:
        lines.append(trace.rstrip())
    else:
        tail = _tail(output_files.get(first))
        lines.append("(no traceback recorded)" + (f"; the last lines of its output:\n{tail.rstrip()}" if tail
                                                   else ""))
    others = [rank for rank in sorted(failures) if rank != first]
    if others:
        lines.append("then: " + "; ".join(f"rank {rank} {_describe(failures[rank])}" for rank in others))
    if log_dir:
        lines.append(f"per-rank output: {log_dir}")
    lines.append("=" * 80)
    return "\n".join(lines)


def add_subcommand(subparsers) -> argparse.ArgumentParser:
    """Register `launch` on the CLI's subparsers; the command runs `main(args)`."""
    parser = subparsers.add_parser(
        "launch", help="start a data-parallel job (torchrun's flags)",
        description=__doc__.split("\n\n")[0], epilog="Every option may also come from PET_<OPTION>, as under "
        "torchrun (e.g. PET_NPROC_PER_NODE=2).", formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(handler=main)
    return parser


def main(args: argparse.Namespace) -> int:
    try:
        plan = plan_launch(args)
    except ValueError as exc:
        print(f"ddpkit launch: {exc}", file=sys.stderr)
        return 2
    return run(plan)
