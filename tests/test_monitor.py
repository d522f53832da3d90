"""Never hang silently: stalls, order mismatches, crashed peers and diverging replicas are named."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import torch

import models
from spawn import run_world

TIMEOUT_S = 8  # the collective timeout (ddp_timeout) of these worlds
STALL_S = 2  # the inspector's threshold


def sleeper_in_a_step(world):
    """Rank 1 sleeps inside its third step while rank 0 waits for it in a bucket all-reduce."""
    import ddpkit

    torch.manual_seed(0)
    ddp = ddpkit.DistributedDataParallel(models.MLP(), bucket_cap_mb=0.002)
    start = None
    try:
        for step in range(4):
            x, y = models.batch("mlp", 4, seed=step)
            loss = models.loss("mlp", ddp, x, y, world.rank, step)
            if world.rank == 1 and step == 2:
                time.sleep(TIMEOUT_S + 6)  # the culprit: far longer than the timeout
            start = time.monotonic()
            loss.backward()
    except ddpkit.StallError as exc:
        return ("stall", time.monotonic() - start, str(exc))
    except Exception as exc:  # noqa: BLE001 - the sleeper finds its peer gone
        return ("other", 0.0, f"{type(exc).__name__}: {exc}")
    return ("finished", 0.0, "")


def test_stall_names_the_rank_and_the_collective():
    rank0, _ = run_world(sleeper_in_a_step, 2, collective_timeout_s=TIMEOUT_S, stall_seconds=STALL_S,
                         deadline_s=90)
    kind, waited, text = rank0
    assert kind == "stall", rank0
    assert waited <= TIMEOUT_S + 5, f"the error came {waited:.1f} s after the wait began"
    assert "ranks that never arrived: [1]" in text, text
    assert "all_reduce (bucket" in text and "backward 3" in text, text
    assert "sleeper_in_a_step" in text and "time.sleep" in text, text  # rank 1's stack, down to the line


def barrier_on_rank_zero_only(world):
    import ddpkit

    comm = ddpkit.Comm.for_group()
    comm.all_reduce(torch.ones(1), "warm-up")
    try:
        if world.rank == 0:
            comm.barrier("checkpoint saved")  # the classic bug
        comm.all_reduce(torch.ones(4), "metrics")
        comm.all_reduce(torch.ones(4), "metrics")
    except ddpkit.StallError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_order_mismatch_is_reported_as_such():
    results = run_world(barrier_on_rank_zero_only, 2, collective_timeout_s=TIMEOUT_S, stall_seconds=STALL_S,
                        deadline_s=90)
    explained = [text for text in results if "ORDER MISMATCH" in text]
    assert explained, results
    text = explained[0]
    assert "barrier (checkpoint saved)" in text and "all_reduce (metrics)" in text, text


def corrupted_replica(world):
    import ddpkit

    torch.manual_seed(0)
    ddp = ddpkit.DistributedDataParallel(models.MLP())
    ddp.check_replicas()
    if world.rank == 2:
        with torch.no_grad():
            ddp.module.net[2].bias[3] += 1e-6
    try:
        ddp.check_replicas()
    except ddpkit.ReplicaDivergenceError as exc:
        return str(exc)
    return "not detected"


def test_replica_divergence_names_rank_and_parameter():
    for text in run_world(corrupted_replica, 3):
        assert "rank 2" in text and "'net.2.bias'" in text, text


CRASHING_SCRIPT = textwrap.dedent("""
    import time, torch, ddpkit
    world = ddpkit.init_process_group(backend="gloo", timeout=300, stall_seconds=60)
    ddpkit.Comm.for_group().all_reduce(torch.ones(1), "hello")
    if world.rank == 1:
        raise ValueError("rank one blew up in its step")
    start = time.monotonic()
    try:
        while True:  # rank 0 computes, never reaching a collective that could fail
            sum(range(10000))
    except ddpkit.PeerFailedError:
        print(f"stopped after {time.monotonic() - start:.1f} s", flush=True)
        raise SystemExit(3)
""")


def test_a_crashed_rank_stops_the_others_quickly(tmp_path):
    from ddpkit.env import free_port

    script = tmp_path / "crash.py"
    script.write_text(CRASHING_SCRIPT)
    port = free_port()
    procs = []
    try:
        for rank in range(2):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "OMP_NUM_THREADS": "1"}
            procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        outputs = [proc.communicate(timeout=60) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    (out0, err0), (out1, err1) = outputs
    assert procs[1].returncode != 0 and "rank one blew up" in err1
    assert procs[0].returncode == 3, (out0, err0)
    stopped = float(out0.split("stopped after ")[1].split(" s")[0])
    assert stopped < 10, f"rank 0 took {stopped} s to stop"
    assert "rank 1 failed" in err0 and "rank one blew up" in err0, err0


HANDLED_PEER_FAILURE = textwrap.dedent("""
    import time
    import torch.distributed as dist
    from ddpkit.monitor import PeerFailedError, StallMonitor, PEER_FAILURE_GRACE_S

    store = dist.HashStore()
    monitor = StallMonitor(store, rank=0, world_size=2, threshold_s=60, poll_s=0.2)
    store.set("ddpkit/monitor/failed/1", "Traceback: rank 1 ran out of memory")
    store.add("ddpkit/monitor/failures", 1)
    try:
        while True:
            time.sleep(0.05)
    except PeerFailedError:
        print("caught", flush=True)
    time.sleep(PEER_FAILURE_GRACE_S + 2)  # handling it (an emergency save, say), in no collective
    print("handled", flush=True)
""")


def test_a_handled_peer_failure_is_not_cut_short(tmp_path):
    """The monitor ends a process only when its main thread is stuck in a collective, not while it handles the
    PeerFailedError it was given."""
    script = tmp_path / "handled.py"
    script.write_text(HANDLED_PEER_FAILURE)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["caught", "handled"], done.stdout
    assert "rank 1 failed" in done.stderr and "ran out of memory" in done.stderr


def slow_then_gone(world):
    """Rank 1 is slow at a first barrier (explained, then resolved), then leaves before the next collective:
    rank 0's error must be about the second collective, not the stale explanation of the first."""
    import ddpkit

    comm = ddpkit.Comm.for_group()
    if world.rank == 1:
        time.sleep(STALL_S + 2)
    comm.barrier("first barrier")
    if world.rank == 1:
        time.sleep(1)
        ddpkit.destroy_process_group()  # gone: its connections close under rank 0's next collective
        return "left"
    try:
        pending = comm.all_reduce(torch.ones(1), "second", async_op=True)
        time.sleep(STALL_S + 1)  # launched long ago, as a bucket is during backward; the wait itself is short
        comm.wait(pending)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_resolved_stall_is_not_blamed_later():
    text, left = run_world(slow_then_gone, 2, collective_timeout_s=TIMEOUT_S, stall_seconds=STALL_S, deadline_s=90)
    assert left == "left"
    assert text != "no error" and "first barrier" not in text and "StallError" not in text, text
