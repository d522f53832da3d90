"""Never hang silently: stalls, order mismatches, crashed peers and diverging replicas are named."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

import torch

from helpers import models
from helpers.world import run_pair, run_world, stay_until

TIMEOUT_S = 8  # the collective timeout (ddp_timeout) of these worlds
STALL_S = 2  # the inspector's threshold


def sleeper_in_a_step(world, done):
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
                # the culprit: away until rank 0 has given up (at its timeout), or far longer than the timeout
                stay_until(done, TIMEOUT_S + 6)
                return ("stayed away", 0.0, "")
            start = time.monotonic()
            loss.backward()
    except ddpkit.StallError as exc:
        return ("stall", time.monotonic() - start, str(exc))
    except Exception as exc:  # noqa: BLE001 - any other error is the wrong outcome, shown as it is
        return ("other", 0.0, f"{type(exc).__name__}: {exc}")
    finally:
        if world.rank == 0:
            open(done, "w").close()
    return ("finished", 0.0, "")


def test_stall_names_the_rank_and_the_collective(tmp_path):
    rank0, _ = run_world(sleeper_in_a_step, 2, args=(str(tmp_path / "done"),), collective_timeout_s=TIMEOUT_S,
                         stall_seconds=STALL_S, deadline_s=90)
    kind, waited, text = rank0
    assert kind == "stall", rank0
    assert waited <= TIMEOUT_S + 5, f"the error came {waited:.1f} s after the wait began"
    assert "ranks that never arrived: [1]" in text, text
    assert "all_reduce (bucket" in text and "backward 3" in text, text
    # rank 1's stack, down to the line it sleeps on
    assert "sleeper_in_a_step" in text and "stay_until(done" in text and "time.sleep" in text, text


MISMATCH_SCRIPT = textwrap.dedent("""
    import time, torch, ddpkit
    world = ddpkit.init_process_group(backend="gloo", timeout=300)  # the inspector's default threshold: 60 s
    comm = ddpkit.Comm.for_group()
    comm.all_reduce(torch.ones(1), "warm-up")
    if world.rank == 1:
        time.sleep(1.5)  # arrives last
    print(f"ENTER {time.time():.3f}", flush=True)
    try:
        if world.rank == 0:
            comm.barrier("checkpoint saved")  # the classic bug
        comm.all_reduce(torch.ones(4), "metrics")
    except ddpkit.StallError as exc:
        print(f"RAISED {type(exc).__name__} {time.time():.3f}", flush=True)
        print(exc, flush=True)
        raise SystemExit(3)
    print("no error", flush=True)
""")


def test_order_mismatch_ends_both_ranks_at_once_with_the_report(tmp_path):
    """rank 0 in a barrier, rank 1 in an all-reduce at the same position: certain, so over in seconds, far
    below the 60 s threshold and the 300 s timeout."""
    (rc0, out0, err0, _), (rc1, out1, err1, _) = run_pair(tmp_path, MISMATCH_SCRIPT)
    entered = max(float(out.split("ENTER ")[1].split()[0]) for out in (out0, out1))
    # rank 1 (the highest) ends the deadlock: it exits with the report; rank 0's collective breaks, it raises it
    assert rc1 == 1 and "no rank can progress: ending the job now" in err1, (out1, err1)
    assert rc0 == 3 and "RAISED DeadlockError" in out0, (out0, err0)
    raised = float(out0.split("RAISED DeadlockError ")[1].split()[0])
    print(f"last rank entered the mismatch -> rank 0 raised the report: {raised - entered:.2f} s")
    assert raised - entered < 20, f"{raised - entered:.1f} s: not the certain-deadlock path"
    for text in (out0, err1):
        assert "ORDER MISMATCH at collective #2: rank 0 called barrier (checkpoint saved) where rank 1 called " \
               "all_reduce (metrics)" in text, text
        assert 'comm.barrier("checkpoint saved")' in text and 'comm.all_reduce(torch.ones(4), "metrics")' in text


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


# ---------------------------------------------------------------------------------------------------------
# A long wait: explained again and again, then the timeout
# ---------------------------------------------------------------------------------------------------------


def long_sleeper(world, done):
    """Rank 1 sleeps past the 10 s timeout (until rank 0 is done, at most 14 s); rank 0 waits in a barrier,
    explained at 1, 2, 4 and 8 s."""
    import ddpkit

    comm = ddpkit.Comm.for_group()
    if world.rank == 1:
        stay_until(done, 14)
        return "slept"
    start = time.monotonic()
    try:
        comm.barrier("after the long load")
    except ddpkit.StallError as exc:
        return (time.monotonic() - start, type(exc).__name__, str(exc))
    finally:
        open(done, "w").close()
    return "no error"


def test_a_long_wait_is_explained_at_growing_intervals_then_times_out(capfd, tmp_path):
    outcome, _ = run_world(long_sleeper, 2, args=(str(tmp_path / "done"),), collective_timeout_s=10,
                           stall_seconds=1, deadline_s=90, expect_errors=True)
    status, value = outcome
    assert status == "ok", value
    waited, kind, text = value
    assert kind == "StallError" and 9 <= waited <= 15, value  # still ends at the timeout, with the explanation
    assert "ranks that never arrived: [1]" in text and "stay_until(done, 14)" in text, text
    printed = [float(s) for s in re.findall(r"\[ddpkit rank 0\] rank 0 has waited (\d+) s in collective",
                                            capfd.readouterr().err)]
    assert len(printed) == 4, printed  # at 1, 2, 4 and 8 s (16 s is past the timeout)
    for seen, due in zip(printed, (1, 2, 4, 8), strict=True):
        assert due <= seen <= due + 2, printed  # polled once a second: at most a poll late


def test_the_interpreter_exits_cleanly_while_the_inspector_polls():
    """The abort at exit after a worker had finished (issue 9): the inspector's daemon thread, inside a store
    call when the interpreter finalized. It polls here as fast as it can, so that the old code aborted in about
    half of the runs; six clean exits in a row."""
    script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "exit_while_polling.py")
    for _ in range(6):
        done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and done.stdout == "exiting\n", (done.returncode, done.stderr[-2000:])
        assert "terminate called" not in done.stderr


def again_on_the_same_store(world):
    """A process group of the same ranks made again on the same store (destroy_process_group, then
    init_process_group, under torchrun's agent store; here two new_group calls): the second group's inspector
    must not read what the first one's posted when its ranks left it."""
    import torch.distributed as dist

    from ddpkit.distributed.comm import Comm
    from ddpkit.doctor.inspector import attach_stall_monitor

    first = Comm.for_group(dist.new_group([0, 1]))
    attach_stall_monitor(first, TIMEOUT_S, STALL_S)
    for _ in range(3):
        first.barrier("first group")
    first.close_observers()  # each rank's inspector posts that it left, after collective #3
    second = Comm.for_group(dist.new_group([0, 1]))
    attach_stall_monitor(second, TIMEOUT_S, STALL_S)
    for _ in range(6):  # past the first group's last sequence number
        second.barrier("second group")
    if world.rank == 1:
        time.sleep(2.5)  # two polls of rank 0's inspector while it waits, well within the timeout
    start = time.monotonic()
    second.barrier("after the sleep")
    waited = time.monotonic() - start
    second.close_observers()
    return waited


def test_a_process_group_made_again_on_the_same_store_does_not_see_the_old_ones_leave():
    waited = run_world(again_on_the_same_store, 2, collective_timeout_s=TIMEOUT_S, stall_seconds=STALL_S,
                       deadline_s=90)
    assert waited[0] > 1.5, waited  # rank 0 really waited over a poll of its inspector, and was not ended
