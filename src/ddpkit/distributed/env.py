"""The launcher's environment, the process group and the one value that describes the world.

This is the only module that reads the launcher's environment variables.

    # torchrun / ddpkit launch: every worker
    world = ddpkit.init_process_group()          # backend picked from the device
    model = ddpkit.DistributedDataParallel(net.to(world.device))
    ...
    ddpkit.destroy_process_group()

Without any launcher (plain ``python train.py``) the same calls give a world of one process, so a script
written for N processes runs unchanged on one.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import sys
import threading
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ddpkit._utils.procfs import pid_namespace
from ddpkit._utils.raising import callers_level
from ddpkit.distributed.backends import backend_for_device, check_backend, default_device_type, node_device_index
from ddpkit.distributed.error_file import ERROR_FILE_VAR, install_worker_excepthook, message_record, write_error_file
from ddpkit.distributed.launcher_watch import session_launcher, watch_parent
from ddpkit.distributed.store import rendezvous
from ddpkit.errors import LaunchError
from ddpkit.distributed.variables import LAUNCHER_PID_NS_VAR, LAUNCHER_PID_VAR, LAUNCHER_RUN_VAR

# The backend each kind of device gets when none is asked for (the Transformers guide's list).
# torch's own default for a process group; the Transformers default for ddp_timeout is the same 1800 s.
DEFAULT_TIMEOUT_S = 1800.0
# What `ddpkit launch` tells its workers of itself: its pid, the PID namespace it holds in, the launch's run id.


class Ranked:
    """The one answer to "is this rank 0", for what the launcher told (LaunchInfo, before any process group) and
    for the world (DistEnv): both have a rank and a local rank."""

    rank: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        """Global rank 0: the one process that writes checkpoints and logs."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """The first process of its node."""
        return self.local_rank == 0


@dataclasses.dataclass(frozen=True)
class LaunchInfo(Ranked):
    """What the launcher told this process, before any process group exists."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    bad_master_port: str | None = None  # MASTER_PORT when it is no port: an error only where the port is used
    launcher: str = "none"  # torchrun, slurm, mpi, or none
    agent_store: bool = False  # torchrun's agent owns MASTER_PORT: connect through env://, never bind it
    restart: int = 0  # how often torchelastic restarted the workers (TORCHELASTIC_RESTART_COUNT)
    elastic: bool = False  # started by torchelastic's agent (ddpkit launch, torchrun): the parent is the launcher
    job: str | None = None  # the launch, the same in all its restarts (TORCHELASTIC_RUN_ID); None: not told
    launcher_pid: int | None = None  # ddpkit launch's pid, valid in this PID namespace; None: not told

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise LaunchError(f"world size must be >= 1, the {self.launcher} environment says {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise LaunchError(
                f"rank {self.rank} is outside the world of {self.world_size} processes "
                f"(launcher: {self.launcher}); check RANK/WORLD_SIZE or their SLURM/MPI equivalents"
            )
        if not 0 <= self.local_rank < max(self.local_world_size, 1):
            raise LaunchError(
                f"local rank {self.local_rank} is outside the {self.local_world_size} processes of this node"
            )


@dataclasses.dataclass(frozen=True)
class DistEnv(Ranked):
    """The world as this process sees it; made once by `init_process_group` and passed down.

    A single process without a launcher is ``DistEnv(rank=0, local_rank=0, world_size=1, ...)``.
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str
    timeout: datetime.timedelta
    launcher: str = "none"
    restart: int = 0  # how often torchelastic restarted this job's workers (0 on the first attempt)
    job: str | None = None  # the launch these workers belong to, the same in every restart (None: unknown)

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def _int(environ: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise LaunchError(f"environment variable {name}={value!r} is not an integer") from None
    return None


def _master_port(env: Mapping[str, str]) -> tuple[int | None, str | None]:
    """MASTER_PORT as a port, or (None, the value) when it is none (not a whole number in torch's 0-65535): a stray
    value must not stop a world of one, which uses no port; ddpkit.distributed.store refuses it where a rendezvous uses it."""
    value = env.get("MASTER_PORT", "").strip()
    return (int(value), None) if value.isdigit() and int(value) < 2**16 else (None, value or None)


def _launcher_pid(env: Mapping[str, str]) -> int | None:
    """ddpkit launch's pid, for the parent watch; None unless this worker's own launch told it (another's values,
    inherited by a job torchrun started, name another run id; torchrun's default "none" names none), or when told
    in another PID namespace (a worker in a namespace of its own), where that number names another process."""
    pid, space = env.get(LAUNCHER_PID_VAR, ""), env.get(LAUNCHER_PID_NS_VAR) or None
    ours = env.get(LAUNCHER_RUN_VAR) == env.get("TORCHELASTIC_RUN_ID") not in (None, "", "none")
    return int(pid) if ours and pid.isdigit() and int(pid) > 0 and space in (None, pid_namespace()) else None


def _slurm_launch(env: Mapping[str, str], addr: str | None, port: int | None, bad_port: str | None) -> LaunchInfo:
    world = _int(env, "SLURM_NTASKS")
    if addr is None:
        # The first node of this step (of the allocation, outside srun), which runs task 0, not where srun was
        # typed (SLURM_LAUNCH_NODE_IPADDR: a login node, perhaps, that runs no task).
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        addr = _first_slurm_host(nodes) if nodes else env.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1")
    if port is None:  # the same on every task of a job, different between jobs sharing a node
        port = 15000 + (_int(env, "SLURM_JOB_ID") or 0) % 20000
    local_size = _int(env, "SLURM_NTASKS_PER_NODE") or _tasks_on_node(
        env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE"), _int(env, "SLURM_NODEID") or 0)
    return LaunchInfo(rank=_int(env, "SLURM_PROCID"), local_rank=_int(env, "SLURM_LOCALID") or 0, world_size=world,
                      local_world_size=local_size or world, master_addr=addr, master_port=port, launcher="slurm",
                      bad_master_port=bad_port)


def _tasks_on_node(spec: str | None, node: int) -> int | None:
    """This node's task count from SLURM's per-node list ("2(x3),1": 2 on each of three nodes, then 1), which
    srun always sets where SLURM_NTASKS_PER_NODE is only set when asked for; None when it cannot say."""
    counts: list[int] = []
    for part in (spec or "").split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node] if node < len(counts) else None


def _refuse_empty(environ: Mapping[str, str], *names: str) -> None:
    for name in names:
        if not environ[name].strip():
            raise LaunchError(f"environment variable {name} is set but empty: set it to an integer, or unset "
                              f"{' and '.join(names)} both for a single process")


def _first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[03-05,09],cpu1' -> 'gpu03'."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if match is None:
        return nodelist
    prefix, ranges = match.group(1), match.group(2)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def read_launch_env(environ: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read rank and world from torchrun, then SLURM, then Open MPI / PMI variables; none: a world of one."""
    env = os.environ if environ is None else environ
    addr = env.get("MASTER_ADDR") or None
    port, bad_port = _master_port(env)
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun, ddpkit launch, accelerate launch, torch.multiprocessing
        _refuse_empty(env, "RANK", "WORLD_SIZE")
        world = _int(env, "WORLD_SIZE")
        return LaunchInfo(
            rank=_int(env, "RANK"),
            local_rank=_int(env, "LOCAL_RANK") or 0,
            world_size=world,
            local_world_size=_int(env, "LOCAL_WORLD_SIZE") or world,
            master_addr=addr,
            master_port=port,
            bad_master_port=bad_port,
            launcher="torchrun",
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
            restart=_int(env, "TORCHELASTIC_RESTART_COUNT") or 0,
            elastic=bool(env.get("TORCHELASTIC_RUN_ID")),
            # A launch's own id: ddpkit launch and torchrun --standalone draw one; "none" is torchrun's default
            # --rdzv-id, shared by every job that keeps it, so it tells nothing.
            job=env.get("TORCHELASTIC_RUN_ID") if env.get("TORCHELASTIC_RUN_ID") not in (None, "", "none") else None,
            launcher_pid=_launcher_pid(env),
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _slurm_launch(env, addr, port, bad_port)
    mpi_rank = _int(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
    mpi_size = _int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
    if mpi_rank is not None and mpi_size is not None:
        return LaunchInfo(
            rank=mpi_rank,
            local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID") or 0,
            world_size=mpi_size,
            local_world_size=_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS") or mpi_size,
            master_addr=addr,
            master_port=port,
            bad_master_port=bad_port,
            launcher="mpi",
        )
    if addr is not None and (port is not None or bad_port is not None):
        warnings.warn(
            "MASTER_ADDR and MASTER_PORT are set but RANK and WORLD_SIZE are not: only ONE training process was "
            "started. This is what `accelerate launch --num_processes N` does on a machine without GPUs unless "
            "--multi_gpu is given. Start N processes with `ddpkit launch --nproc-per-node N train.py`, "
            "`torchrun --nproc_per_node=N train.py` or `accelerate launch --multi_gpu --num_processes N train.py`. "
            "Continuing as a single process.",
            RuntimeWarning,
            stacklevel=callers_level(),
        )
    return LaunchInfo()


def is_main_process(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is global rank 0 of the job its launcher describes (True without a launcher);
    readable before any process group exists, e.g. to print an error once instead of once per rank."""
    try:
        return read_launch_env(environ).is_main
    except LaunchError:
        return True  # an environment that does not parse: better every rank says it than none


def report_startup_error(text: str) -> None:
    """Show, once for the whole job, an error that stops every rank before any process group exists (a bad
    command-line flag): under ddpkit launch or torchrun every rank records it as its error, so whichever rank
    exits first is a root cause with the message (the launcher's summary prints the root cause's alone; rank 0
    only recording it was lost when another rank exited first and the agent stopped rank 0 before it wrote);
    without a launcher rank 0 prints it and the other ranks stay silent."""
    path = os.environ.get(ERROR_FILE_VAR)
    if path and write_error_file(path, message_record(text)):
        return
    if is_main_process():
        print(text, file=sys.stderr, flush=True)


def to_timeout(timeout: float | int | datetime.timedelta | None) -> datetime.timedelta:
    if timeout is None:
        return datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {timeout.total_seconds()} s")
    return timeout


def _pin_device(device_type: str, local_rank: int | None) -> torch.device:
    """This process's device: `local_rank`'s, or the one already current (None: a process group adopted without a
    launcher's local rank, whose maker pinned the device, as torch's mp.spawn examples do)."""
    if device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, device_type)
    count = module.device_count()
    if local_rank is None:
        return _adopted_device(device_type, module, count)
    local_rank = node_device_index(local_rank, count)
    if local_rank >= count:
        raise LaunchError(
            f"local rank {local_rank} needs {device_type}:{local_rank} but only {count} {device_type} device(s) "
            f"are visible; start at most {count} processes per node"
        )
    module.set_device(local_rank)
    return torch.device(device_type, local_rank)


def _adopted_device(device_type: str, module: Any, count: int) -> torch.device:
    """The device of a process in a group made by hand without a launcher (mp.spawn): the one the group is bound
    to (init_process_group(device_id=...)), or the current one where its maker pinned it; torch's DDP tutorial
    only moves the model (`model.to(rank)`), and every rank left on device 0 would make NCCL fail ("Duplicate GPU
    detected"): then rank r, as there, takes device r of this node."""
    bound = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)
    current = module.current_device()
    index = current
    if bound is not None and bound.type == device_type and bound.index is not None:
        index = bound.index
    elif current == 0 and count > 1:
        index = dist.get_rank() % count
    if index != current:
        module.set_device(index)
    return torch.device(device_type, index)


def init_process_group(
    backend: str | None = None,
    timeout: float | datetime.timedelta | None = None,
    device_type: str | None = None,
    environ: Mapping[str, str] | None = None,
    join_timeout: float | datetime.timedelta | None = None,
) -> DistEnv:
    """Join the world the launcher described, pin this process to its device and return the world.

    backend: nccl, gloo, xccl, hccl, cncl, or None to pick by device (cuda->nccl, cpu->gloo, ...).
    timeout: seconds (or a timedelta) after which any collective raises instead of hanging.
    join_timeout: how long to wait for every process of the world to arrive (default: `timeout`); past it,
    a clear error says how many arrived.
    An existing default process group (made by accelerate, say) is adopted as it is.
    """
    install_worker_excepthook()  # under a launcher, an uncaught exception becomes the job's root cause
    adopted = dist.is_initialized()
    with warnings.catch_warnings():
        if adopted:  # a group made by hand (mp.spawn) needs no launcher: its maker started the processes
            warnings.simplefilter("ignore", RuntimeWarning)
        info = read_launch_env(environ)
    if info.elastic and not any(t.name == "ddpkit-parent-watch" for t in threading.enumerate()):
        watch_parent(launcher=info.launcher_pid or session_launcher((environ or os.environ).get("TORCHELASTIC_RUN_ID")))
    device_type = device_type or default_device_type()
    timeout = to_timeout(timeout)
    if adopted:
        device = _pin_device(device_type, None if info.launcher == "none" else info.local_rank)
        local, local_size = info.local_rank, info.local_world_size
        if info.launcher == "none" and dist.get_world_size() > 1:  # mp.spawn on one node, rank r on device r
            local = device.index if device.index is not None else dist.get_rank()
            local_size = dist.get_world_size()
        return DistEnv(dist.get_rank(), local, dist.get_world_size(), local_size, device, dist.get_backend(),
                       timeout, info.launcher, info.restart, info.job)
    backend = backend or backend_for_device(device_type)
    check_backend(backend)
    backend = str(dist.Backend(backend))  # torch's spelling: "GLOO" is "gloo" (DistEnv, the nccl test below)
    device = _pin_device(device_type, info.local_rank)
    kwargs = dict(backend=backend, timeout=timeout)
    if backend == "nccl":
        kwargs["device_id"] = device  # lets NCCL connect eagerly and bind the communicator to our GPU
    if info.world_size == 1 and info.launcher in ("none", "slurm", "mpi"):
        # A world of one needs no rendezvous: an in-memory store, no port, and every collective still works
        # (under SLURM or MPI too: a port derived from the job id would collide with another step's world of one).
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    else:
        store = rendezvous(info, to_timeout(join_timeout) if join_timeout is not None else timeout)
        store.set_timeout(timeout)
        dist.init_process_group(store=store, rank=info.rank, world_size=info.world_size, **kwargs)
    return DistEnv(info.rank, info.local_rank, info.world_size, info.local_world_size, device, backend, timeout,
                   info.launcher, info.restart, info.job)


def single_process_env(device: torch.device | str = "cpu") -> DistEnv:
    """The world of one process, without any process group (for code paths that never communicate)."""
    return DistEnv(0, 0, 1, 1, torch.device(device), "none", to_timeout(None))


def destroy_process_group() -> None:
    """Leave the world; a no-op when no process group exists."""
    if dist.is_initialized():
        dist.destroy_process_group()
