"""The stall inspector's reasoning (ddpkit.doctor.diagnosis), without processes: when explanations come, and when a
deadlock is certain."""

from __future__ import annotations

import os
import subprocess
import time


def test_explanations_come_within_a_minute_then_at_each_doubling():
    from ddpkit.doctor import diagnosis

    assert diagnosis.default_threshold(1800) == 60 and diagnosis.default_threshold(100) == 20
    assert diagnosis.explanation_times(60, 1800) == [60, 120, 240, 480, 960]
    assert diagnosis.explanation_times(2, 8) == [2, 4]
    assert [diagnosis.explanation_due(1.5, n) for n in range(4)] == [1.5, 3, 6, 12]
    assert diagnosis.explanation_times(0, 100) == []


def _state(rank, published, seq, op, what, wait_id, issued=()):
    return {"rank": rank, "host": "h", "pid": 100 + rank, "published": published, "done_seq": (seq or 1) - 1,
            "done_what": "", "stack": f'  File "train.py", line {10 + rank}, in main\n',
            "issued": [list(x) for x in issued],
            "waiting": None if seq is None else {"seq": seq, "op": op, "what": what, "for_s": 1.0, "id": wait_id}}


def test_a_deadlock_is_certain_only_from_fresh_states_of_every_rank():
    from ddpkit.doctor.diagnosis import left_deadlock, mismatch_deadlock

    before = {0: _state(0, 5, 7, "all_reduce", "eval loss", 3), 1: _state(1, 4, 7, "barrier", "save_model", 9)}
    now = {0: _state(0, 6, 7, "all_reduce", "eval loss", 3), 1: _state(1, 5, 7, "barrier", "save_model", 9)}
    report = mismatch_deadlock(before, now)
    assert report.startswith("DEADLOCK") and "ORDER MISMATCH at collective #7: rank 0 called all_reduce (eval " \
        "loss) where rank 1 called barrier (save_model)" in report
    assert "train.py\", line 10" in report and "train.py\", line 11" in report  # where each rank called it
    assert mismatch_deadlock({}, now) is None  # seen once: could be a state from before the wait
    stale = {**now, 1: _state(1, 4, 7, "barrier", "save_model", 9)}  # rank 1 did not publish again
    assert mismatch_deadlock(before, stale) is None
    other_wait = {**now, 1: _state(1, 5, 7, "barrier", "save_model", 10)}  # a new wait since the last poll
    assert mismatch_deadlock(before, other_wait) is None
    computing = {**now, 1: _state(1, 5, None, "", "", 0)}
    assert mismatch_deadlock(before, computing) is None
    same = {r: _state(r, 6 - r, 7, "all_reduce", "loss", 3) for r in (0, 1)}  # a slow collective, no conflict
    assert mismatch_deadlock({r: _state(r, 5 - r, 7, "all_reduce", "loss", 3) for r in (0, 1)}, same) is None
    # different positions, but their issued collectives part at #5: rank 1 skipped an all-reduce there
    skipped_before = {0: _state(0, 1, 6, "barrier", "end", 4, [(5, "all_reduce", "a")]),
                      1: _state(1, 1, 5, "barrier", "end", 2)}
    skipped_now = {r: {**st, "published": 2} for r, st in skipped_before.items()}
    assert "ORDER MISMATCH at collective #5: rank 0 called all_reduce (a) where rank 1 called barrier (end)" \
        in mismatch_deadlock(skipped_before, skipped_now)
    # a rank that left after #6: a wait in #7 can never end; one in #6 may still (its data may be in flight)
    marker = {1: {"rank": 1, "seq": 6, "what": "all_reduce (logged loss)", "how": "its process exited"}}
    report = left_deadlock(now[0], marker)
    assert report.startswith("rank 1 left the job early (its process exited) after collective #6 all_reduce "
                             "(logged loss): the root cause. Rank 0 waits for it in collective #7"), report
    assert left_deadlock(_state(0, 6, 6, "all_reduce", "logged loss", 3), marker) is None


def test_a_peer_whose_process_ended_without_a_word_is_named_with_where_it_was():
    from ddpkit.doctor import diagnosis

    here = {"host": "h", "procs": "boot/pid:[1]"}
    states = {0: {"rank": 0, **here, "pid": 10, "waiting": {"seq": 7, "op": "all_reduce", "what": "loss"}},
              1: {"rank": 1, **here, "pid": 11, "waiting": None, "done_seq": 6, "done_what": "barrier (x)"},
              # another host's, or a container's on this host (its own pid namespace): their pids mean nothing here
              2: {"rank": 2, "host": "other", "procs": "boot2/pid:[1]", "pid": 11, "waiting": None},
              3: {"rank": 3, "host": "h", "procs": "boot/pid:[2]", "pid": 11, "waiting": None},
              4: None}
    text = diagnosis.vanished(states, 0, "boot/pid:[1]", ended=lambda pid: pid == 11)
    assert text == ("rank 1 (pid 11 on h) ended without telling the others of an error or that it left "
                    "(os._exit, a signal such as SIGKILL or SIGINT, the out-of-memory killer, or an abort inside a "
                    "library), its state posted last (each second) after collective #6 barrier (x): the root cause")
    assert diagnosis.vanished(states, 0, "boot/pid:[1]", ended=lambda pid: False) is None
    assert diagnosis.vanished(states, 0, None, ended=lambda pid: True) is None  # no /proc: nothing is judged
    gone = diagnosis.vanished(states, 1, "boot/pid:[1]", ended=lambda pid: True)
    assert gone.startswith("rank 0 (pid 10 on h) ended without telling the others") and "#7 all_reduce (loss)" in gone
    assert "rank 2" not in gone and "rank 3" not in gone
    assert diagnosis.process_space().startswith(open("/proc/sys/kernel/random/boot_id").read().strip())
    # The real thing: this process lives; a child that exited has ended, still a zombie (not reaped) or reaped.
    child = subprocess.Popen(["sleep", "0.2"])
    assert not diagnosis.process_ended(child.pid) and not diagnosis.process_ended(os.getpid())
    deadline = time.monotonic() + 10
    while not diagnosis.process_ended(child.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    with open(f"/proc/{child.pid}/stat") as f:
        assert f.read().rsplit(")", 1)[1].split()[0] == "Z"  # ended, unreaped: Popen has not waited
    child.wait()
    assert diagnosis.process_ended(child.pid)


def test_a_rank_that_reports_nothing_any_more_is_not_said_to_compute_now():
    """A SIGSTOPped rank's last report (computing after #2) was shown as what it did 17 s later."""
    from ddpkit.doctor.diagnosis import explain

    now = time.time()
    waiting = {**_state(0, 9, 7, "all_reduce", "loss", 3), "time": now}
    frozen = {**_state(1, 4, None, "", "", 0), "time": now - 17.2, "done_seq": 2, "done_what": "broadcast (buffers)"}
    text = explain(0, {0: waiting, 1: frozen})
    assert "rank 1 (host h, pid 101) never arrived: it has reported nothing for 17 s (stopped, frozen" in text
    assert "when it last did, it is computing; its last collective was #2 broadcast (buffers)" in text
    fresh = explain(0, {0: waiting, 1: {**frozen, "time": now - 1.0}}, now=now)
    assert "never arrived: it is computing; its last collective was #2" in fresh and "reported nothing" not in fresh
    elsewhere = explain(0, {0: waiting, 1: {**frozen, "host": "other"}})  # another host's clock: not compared
    assert "reported nothing" not in elsewhere
