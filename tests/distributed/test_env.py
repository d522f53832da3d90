"""Reading the launcher's environment, choosing a backend, the world of one, and collective timeouts."""

from __future__ import annotations

import time
import types

import pytest
import torch

import ddpkit
import ddpkit.distributed.env
from ddpkit.distributed.env import read_launch_env, to_timeout
from ddpkit.errors import LaunchError
from helpers.world import run_world, stay_until


def test_torchrun_variables():
    info = read_launch_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
                            "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (3, 4, 1, 2)
    assert (info.master_addr, info.master_port, info.launcher, info.agent_store) == ("10.0.0.1", 29500,
                                                                                     "torchrun", True)


def test_torchrun_wins_over_slurm_and_slurm_over_mpi():
    both = {"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "OMPI_COMM_WORLD_RANK": "1",
            "OMPI_COMM_WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert read_launch_env(both).launcher == "torchrun"
    del both["RANK"], both["WORLD_SIZE"]
    assert read_launch_env(both).launcher == "slurm"


def test_slurm_variables():
    info = read_launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                            "SLURM_NTASKS_PER_NODE": "4", "SLURM_NODELIST": "gpu[03-05,09],cpu1",
                            "SLURM_JOB_ID": "1234"})
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (5, 8, 1, 4)
    assert info.master_addr == "gpu03" and info.master_port == 15000 + 1234
    assert info.launcher == "slurm" and not info.agent_store
    # srun typed on a login node: the first node of the allocation runs task 0 and hosts the store, not that node
    login = read_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "gpu[03-04]",
                             "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.99"})
    assert login.master_addr == "gpu03"
    # A step on part of the allocation: its own first node runs its task 0
    step = read_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "node[01-04]",
                            "SLURM_STEP_NODELIST": "node[03-04]"})
    assert step.master_addr == "node03"
    # `srun -N2 -n4` sets no SLURM_NTASKS_PER_NODE: the local world is this node's count, not the whole world's
    spread = read_launch_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "5", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
                              "SLURM_TASKS_PER_NODE": "2(x2),1", "SLURM_JOB_NODELIST": "node[01-03]"})
    assert (spread.world_size, spread.local_world_size) == (5, 2)
    last = read_launch_env({"SLURM_PROCID": "4", "SLURM_NTASKS": "5", "SLURM_NODEID": "2",
                            "SLURM_STEP_TASKS_PER_NODE": "2(x2),1", "SLURM_JOB_NODELIST": "node[01-03]"})
    assert last.local_world_size == 1


def test_mpi_variables():
    info = read_launch_env({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3",
                            "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"})
    assert (info.rank, info.world_size, info.local_rank, info.launcher) == (2, 3, 0, "mpi")
    assert read_launch_env({"PMI_RANK": "1", "PMI_SIZE": "2"}).world_size == 2


def test_no_launcher_is_a_world_of_one():
    info = read_launch_env({})
    assert (info.rank, info.world_size, info.launcher) == (0, 1, "none")


def test_accelerate_without_multi_gpu_warns_loudly():
    with pytest.warns(RuntimeWarning, match="only ONE training process") as warned:
        info = read_launch_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    assert info.world_size == 1
    assert warned[0].filename == __file__  # the user's line, also through init_process_group (was comm.py's)


@pytest.mark.parametrize("environ, message", [
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "outside the world"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "world size must be >= 1"),
    ({"RANK": "", "WORLD_SIZE": "2"}, "RANK is set but empty"),
    ({"RANK": "0", "WORLD_SIZE": " "}, "WORLD_SIZE is set but empty"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"}, "local rank 3"),
])
def test_bad_environment_is_named(environ, message):
    with pytest.raises(LaunchError, match=message):
        read_launch_env(environ)


def test_timeouts():
    assert to_timeout(None).total_seconds() == 1800
    assert to_timeout(2.5).total_seconds() == 2.5
    with pytest.raises(ValueError, match="positive"):
        to_timeout(0)


def test_world_of_one_without_launcher(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    world = ddpkit.init_process_group()
    try:
        assert (world.rank, world.world_size, world.is_main, world.device.type) == (0, 1, True, "cpu")
        comm = ddpkit.Comm()
        t = torch.ones(3)
        comm.all_reduce(t)
        assert t.tolist() == [1, 1, 1]
        assert comm.all_gather_object({"a": 1}) == [{"a": 1}]
        ddpkit.barrier(world)
        with ddpkit.main_process_first(world):
            pass
    finally:
        ddpkit.destroy_process_group()


def late_rank(world, done_flag):
    """Rank 1 never joins the all-reduce: rank 0 must get an error at the timeout, not hang."""
    comm = ddpkit.Comm()
    if world.rank == 0:
        start = time.monotonic()
        try:
            comm.all_reduce(torch.ones(1))
        except Exception as exc:  # gloo raises a RuntimeError-like DistBackendError
            return ("raised", time.monotonic() - start, type(exc).__name__)
        finally:
            open(done_flag, "w").close()
        return ("returned", time.monotonic() - start, "")
    stay_until(done_flag)  # up until rank 0 is done (at most 60 s)
    return ("slept", 0.0, "")


def test_collective_timeout_raises(tmp_path):
    rank0, _ = run_world(late_rank, 2, args=(str(tmp_path / "rank0-done"),), collective_timeout_s=2, deadline_s=60)
    assert rank0[0] == "raised", rank0
    assert rank0[1] < 5, f"the 2 s timeout took {rank0[1]:.1f} s to fire"


def _launch_env(port: int, rank: int = 0, world_size: int = 2) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def test_port_in_use_is_named(monkeypatch):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        environ = _launch_env(port)
        monkeypatch.setattr("os.environ", {**environ})
        with pytest.raises(LaunchError, match=f"MASTER_PORT {port} is already in use"):
            ddpkit.distributed.env.init_process_group(backend="gloo", environ=environ, join_timeout=5)


def test_world_size_larger_than_the_processes_started(monkeypatch):
    from helpers.world import free_port

    environ = _launch_env(free_port(), world_size=3)
    monkeypatch.setattr("os.environ", {**environ})  # env:// reads the same variables
    start = time.monotonic()
    with pytest.raises(LaunchError, match="WORLD_SIZE"):
        ddpkit.distributed.env.init_process_group(backend="gloo", environ=environ, join_timeout=2)
    assert time.monotonic() - start < 30


def test_device_pinning(monkeypatch):
    """One device per local rank; one device bound to each task (SLURM --gpus-per-task=1) whatever the local
    rank; the device already current where a process group made by hand is adopted (torch's mp.spawn pattern)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert ddpkit.distributed.env._pin_device("cuda", 1) == torch.device("cuda", 1) and calls == [1]
    group = types.SimpleNamespace(bound_device_id=None)
    monkeypatch.setattr(ddpkit.distributed.env.dist.distributed_c10d, "_get_default_group", lambda: group)
    monkeypatch.setattr(ddpkit.distributed.env.dist, "get_rank", lambda: 2)
    assert ddpkit.distributed.env._pin_device("cuda", None) == torch.device("cuda", 3) and calls == [1]  # left as it was
    # Left on device 0 (torch's tutorial moves only the model): rank r takes device r, as NCCL needs; the device
    # a group was bound to (init_process_group(device_id=...)) wins.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert ddpkit.distributed.env._pin_device("cuda", None) == torch.device("cuda", 2) and calls == [1, 2]
    group.bound_device_id = torch.device("cuda", 1)
    assert ddpkit.distributed.env._pin_device("cuda", None) == torch.device("cuda", 1) and calls == [1, 2, 1]
    calls.clear()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert ddpkit.distributed.env._pin_device("cuda", 2) == torch.device("cuda", 0) and calls == [0]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(LaunchError, match="local rank 2 needs cuda:2 but only 2"):
        ddpkit.distributed.env._pin_device("cuda", 2)


def test_a_process_group_made_by_hand_is_adopted_without_the_one_process_warning(monkeypatch, recwarn):
    import torch.distributed as dist

    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        world = ddpkit.init_process_group()
        assert (world.rank, world.world_size, world.device.type) == (0, 1, "cpu")
        assert not [w for w in recwarn if "only ONE training process" in str(w.message)]
    finally:
        dist.destroy_process_group()


def test_a_slurm_world_of_one_binds_no_port(monkeypatch):
    """Two `srun -n1` steps of one job on one node derived the same port from the job id: the second failed."""
    import socket

    import torch.distributed as dist

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        environ = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "777", "SLURM_JOB_NODELIST": "localhost",
                   "MASTER_PORT": str(taken.getsockname()[1])}
        monkeypatch.setattr("os.environ", {**environ})
        world = ddpkit.distributed.env.init_process_group(backend="gloo", environ=environ, join_timeout=5)
        try:
            assert (world.rank, world.world_size, world.launcher) == (0, 1, "slurm")
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize("port", ["abc", "70000"])
def test_a_stray_master_port_stops_no_world_of_one_and_is_named_where_it_is_used(monkeypatch, port):
    """MASTER_PORT=abc stopped even a world of one, which uses no port ("is not an integer"); where a rendezvous
    uses it, torch said "invalid literal for int()" or "port must have value from 0 to 65535" without naming it."""
    import torch.distributed as dist

    for environ in ({"MASTER_PORT": port}, {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "MASTER_PORT": port},
                    {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1", "MASTER_PORT": port}):
        monkeypatch.setattr("os.environ", {**environ})
        world = ddpkit.distributed.env.init_process_group(backend="gloo", environ=environ)
        try:
            assert (world.rank, world.world_size) == (0, 1)
        finally:
            dist.destroy_process_group()
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "localhost", "MASTER_PORT": port}
    for environ in ({**_launch_env(0), "MASTER_PORT": port}, {**_launch_env(0, world_size=1), "MASTER_PORT": port},
                    slurm):
        monkeypatch.setattr("os.environ", {**environ})  # env:// reads the same variables
        with pytest.raises(ValueError, match=rf"MASTER_PORT='{port}' is not a port number .* MASTER_PORT=29500"):
            ddpkit.distributed.env.init_process_group(backend="gloo", environ=environ, join_timeout=5)


def test_the_launchers_pid_is_read_in_its_own_pid_namespace_only():
    from ddpkit._utils.procfs import pid_namespace

    told = {"RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "x", "DDPKIT_LAUNCHER_PID": "4242",
            "DDPKIT_LAUNCHER_RUN_ID": "x"}
    assert read_launch_env(told).launcher_pid == 4242
    # another launch's values, inherited by a job torchrun started (with its own run id, or its default "none")
    for run in ("y", "none"):
        assert read_launch_env({**told, "TORCHELASTIC_RUN_ID": run}).launcher_pid is None
    assert read_launch_env({**told, "TORCHELASTIC_RUN_ID": "none", "DDPKIT_LAUNCHER_RUN_ID": "none"}).launcher_pid \
        is None
    assert read_launch_env({**told, "DDPKIT_LAUNCHER_PID_NS": pid_namespace() or ""}).launcher_pid == 4242
    # a worker in a PID namespace of its own: that number names another process there
    assert read_launch_env({**told, "DDPKIT_LAUNCHER_PID_NS": "pid:[1]"}).launcher_pid is None
    assert read_launch_env({**told, "DDPKIT_LAUNCHER_PID": "x"}).launcher_pid is None
    del told["DDPKIT_LAUNCHER_PID"]  # torchrun, accelerate launch: the watch takes the parent for the launcher
    assert read_launch_env(told).launcher_pid is None
