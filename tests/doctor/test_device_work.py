"""The stall inspector where a wait returns before its collective completed (NCCL's, on the GPU): the collectives
the device has not completed (ddpkit.doctor.device_work), and the inspector explaining and ending a stall there.

No GPU here: `QueuedGloo` makes a gloo world behave as NCCL does for the CPU (see its docstring), so these tests
run the Comm, the observer seam and the inspector as they run on NCCL, with a stand-in for the device's stream."""

from __future__ import annotations

import json
import os
import re
import threading
import time

import pytest
import torch
import torch.distributed as dist

from helpers import models
from helpers.world import run_world

STALL_S = 2  # the inspector's threshold in the worlds below
AWAY_S = STALL_S + 4  # how long the culprit stays away: explained twice, back well before the timeout
TIMEOUT_S = 30  # the collective timeout: gloo's own queued collectives must outlast the stall


class _Record:
    def __init__(self, seq, op="all_reduce", what="", device="cuda:0"):
        self.seq, self.op, self.what, self.device = seq, op, what, device


def test_unfinished_counts_what_completed_and_names_the_oldest_collective_left():
    from ddpkit.doctor.device_work import Unfinished

    unfinished = Unfinished()
    done = {1: False, 2: True, 3: False}

    def failed():
        raise RuntimeError("the device is gone")

    for seq in (3, 1, 2):  # waited for out of order (a comm hook's bucket after a later all-reduce)
        unfinished.add(_Record(seq, what=f"bucket {seq}"), lambda seq=seq: done[seq], wait_id=10 + seq)
    unfinished.add(_Record(4), failed, wait_id=14)
    assert unfinished.oldest() is None  # nothing counted before the inspector's thread settles them
    assert [r.seq for r in unfinished.settle()] == [2]
    oldest = unfinished.oldest()
    assert (oldest.seq, oldest.what, oldest.id, oldest.device) == (1, "bucket 1", 11, "cuda:0")
    assert unfinished.oldest(unfinished_for=60) is None  # unfinished for less: the pipeline at work
    done[1] = done[3] = True
    assert [r.seq for r in unfinished.settle()] == [1, 3]  # in sequence order; the failed one never counts
    assert unfinished.oldest() is None and unfinished.settle() == []
    unfinished.close()
    unfinished.add(_Record(5), lambda: False, wait_id=15)  # nothing settles them any more: kept nowhere
    assert unfinished.settle() == [] and unfinished.oldest() is None


def _read_until(capfd, predicate, limit_s: float) -> str:
    """What the process wrote to stderr, once `predicate(text)` holds (or `limit_s` passed)."""
    text, end = "", time.monotonic() + limit_s
    while not predicate(text) and time.monotonic() < end:
        time.sleep(0.05)
        text += capfd.readouterr().err
    return text


def test_the_inspector_waits_in_a_device_collective_until_its_test_says_it_completed(capfd):
    from ddpkit.distributed.collective import CollectiveRecord
    from ddpkit.doctor.inspector import StallMonitor

    monitor = StallMonitor(dist.HashStore(), rank=0, world_size=1, threshold_s=0.5, poll_s=0.1)
    completed = threading.Event()
    try:
        gpu = torch.device("cuda", 0)
        loss = CollectiveRecord(1, "all_reduce", "loss", 8, time.monotonic(), gpu)
        metrics = CollectiveRecord(2, "all_reduce", "metrics", 8, time.monotonic(), gpu)
        for record, test in ((loss, lambda: True), (metrics, completed.is_set)):
            monitor.issued(record)
            monitor.finished(record, None)  # NCCL's future is complete once the collective is enqueued
            monitor.wait_began(record)
            monitor.wait_ended(record, None)  # at once
            monitor.deferred(record, test)
        assert monitor.done_seq == 0  # enqueued is not finished
        err = _read_until(capfd, lambda text: "has waited" in text, limit_s=5)
        assert re.search(r"\[ddpkit rank 0\] rank 0 has waited \d s in collective #2 all_reduce \(metrics\), "
                         r"which cuda:0 has not completed\.", err), err
        assert (monitor.done_seq, monitor.done_what) == (1, "all_reduce (loss)")
        assert "collective #2" in monitor.explain()
        completed.set()
        end = time.monotonic() + 5
        while monitor.done_seq < 2 and time.monotonic() < end:
            time.sleep(0.05)
        assert (monitor.done_seq, monitor.done_what) == (2, "all_reduce (metrics)")
        assert monitor.explain() == "not waiting in any collective"
    finally:
        monitor.close()


# ---------------------------------------------------------------------------------------------------------------
# A gloo world made to behave as NCCL does
# ---------------------------------------------------------------------------------------------------------------


def _succeeded(work) -> bool:
    future = work.get_future()
    if not future.done():
        return False
    try:
        future.value()
    except Exception:  # noqa: BLE001 - failed: on a GPU its kernel would never have ended
        return False
    return True


class _Enqueued:
    """NCCL's Work as the CPU sees it: its wait returns at once, its future is complete at once."""

    def __init__(self, tensor):
        self.tensor = tensor

    def wait(self, timeout=None):
        return True

    def get_future(self):
        future = torch.futures.Future()
        future.set_result([self.tensor])
        return future


class QueuedGloo:
    """A CPU stand-in for NCCL in this rank's process: every all-reduce is started on gloo and returns at once,
    blocking or not, as does its wait (`_Enqueued`); `synchronize` blocks as a CUDA synchronize or a `.item()`
    does, until everything started has completed (a failed one never, as a kernel waiting for a peer that left).
    The rank's Comm is told that CPU tensors complete later (`deferred_on`), and its completion test is an event
    on this stream: it says True once everything started before it has completed."""

    def __init__(self, comm):
        self.started: list = []
        self._all_reduce = dist.all_reduce
        dist.all_reduce = self.all_reduce  # Comm calls torch.distributed's functions: this forked rank's only
        comm.deferred_on = lambda device: device
        comm.completion_test = self.event

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        self.started.append(self._all_reduce(tensor, op=op, group=group, async_op=True))
        return _Enqueued(tensor) if async_op else None

    def event(self, device):
        before = list(self.started)
        return lambda: all(_succeeded(work) for work in before)

    def synchronize(self, limit_s: float = 60) -> float:
        """Block until everything started has completed (at most `limit_s`); how long that took."""
        began, done = time.monotonic(), self.event(None)
        while not done() and time.monotonic() < began + limit_s:
            time.sleep(0.01)
        return time.monotonic() - began


def stalled_on_the_device(world):
    """Rank 1 stays away inside its third step; rank 0's buckets are started and waited for at once, and rank 0
    blocks in `synchronize` (its loss.item()), outside every Comm wait. Before that, both ranks idle after
    collectives that completed: nothing to report then."""
    import ddpkit

    torch.manual_seed(0)
    ddp = ddpkit.DistributedDataParallel(models.MLP(), bucket_cap_mb=0.002)
    device = QueuedGloo(ddpkit.Comm.for_group())
    blocked = []
    for step in range(4):
        x, y = models.batch("mlp", 4, seed=step)
        loss = models.loss("mlp", ddp, x, y, world.rank, step)
        if world.rank == 1 and step == 2:
            time.sleep(AWAY_S)  # the culprit
        loss.backward()
        blocked.append(device.synchronize())
        if step == 1:
            time.sleep(2 * STALL_S + 1)  # idle, everything completed: nothing is unfinished
    return blocked


def test_a_stall_on_a_device_backend_is_explained_and_a_completed_collective_is_not(capfd):
    blocked, _ = run_world(stalled_on_the_device, 2, collective_timeout_s=TIMEOUT_S, stall_seconds=STALL_S,
                           deadline_s=120)
    assert blocked[2] > STALL_S + 1, blocked  # rank 0 really blocked in its synchronize over the threshold
    err = capfd.readouterr().err
    explained = re.findall(r"\[ddpkit rank (\d)\] rank \d has waited (\d+) s in collective #\d+ all_reduce "
                           r"\(bucket \d+, backward (\d+)\), which cpu has not completed\.", err)
    assert explained, err
    # only rank 0, only the stalled step's buckets: not the collectives that had completed before the idle time
    assert {(rank, backward) for rank, _, backward in explained} == {("0", "3")}, explained
    first = int(explained[0][1])
    assert STALL_S <= first <= STALL_S + 2, explained  # at the threshold, a poll late at most (and load)
    text = err[err.index("[ddpkit rank 0] rank 0 has waited"):]
    assert "ranks that never arrived: [1]" in text, text
    # rank 1's stack, down to the line it stays away on
    assert "in stalled_on_the_device" in text and "time.sleep(AWAY_S)" in text, text


def left_while_queued(world, folder):
    """Rank 1 leaves after the first collective; rank 0's second one is started and waited for (at once), and
    rank 0 blocks in `synchronize`: a certain deadlock, which the inspector must end."""
    import ddpkit

    os.environ["TORCHELASTIC_ERROR_FILE"] = os.path.join(folder, f"error{world.rank}.json")
    comm = ddpkit.Comm.for_group()
    device = QueuedGloo(comm)
    comm.all_reduce(torch.ones(2), "warm-up")
    device.synchronize()
    if world.rank == 1:
        ddpkit.destroy_process_group()  # gone after collective #1, as a rank that returned early
        return "left"
    comm.all_reduce(torch.ones(2), "metrics")  # never completes: rank 1 will never call it
    return f"synchronize returned after {device.synchronize(limit_s=30):.1f} s"


def test_a_peer_that_left_ends_a_wait_on_the_device_with_the_report(tmp_path, capfd):
    began = time.monotonic()
    with pytest.raises(RuntimeError, match=r"ranks died without a result \(exit codes \{0: 1\}\)"):
        run_world(left_while_queued, 2, args=(str(tmp_path),), collective_timeout_s=TIMEOUT_S,
                  stall_seconds=60, deadline_s=90)
    took = time.monotonic() - began
    err = capfd.readouterr().err
    report = ("rank 1 left the job early (it called destroy_process_group) after collective #1 all_reduce "
              "(warm-up): the root cause. Rank 0 waits for it in collective #2 all_reduce (metrics), which rank 1 "
              "never joined (a certain deadlock).")
    assert f"[ddpkit rank 0] {report}" in err and "no rank can progress: ending the job now" in err, err
    assert "on cpu; its main thread is now at" in err and "device.synchronize(limit_s=30)" in err, err
    record = json.loads((tmp_path / "error0.json").read_text())["message"]
    assert record["message"].startswith(f"PeerLeftError: {report}"), record
    assert "device.synchronize(limit_s=30)" in record["extraInfo"]["py_callstack"], record
    assert took < 25, f"{took:.1f} s: the threshold is 60 s, only the certain-deadlock path ends it this soon"
