"""Comm's observer seam: every collective's events reach every observer, in order, and asynchronous collectives
are reported finished when they complete, not when someone waits."""

from __future__ import annotations

import time

import torch

from spawn import run_world


def _recorder():
    from ddpkit.comm import CommObserver

    class Recorder(CommObserver):
        def __init__(self):
            self.events = []
            self.closed = False

        def issued(self, record):
            self.events.append(("issued", record.seq, record.op, record.what, record.nbytes))

        def wait_began(self, record):
            self.events.append(("began", record.seq))

        def wait_ended(self, record, error):
            self.events.append(("ended", record.seq, type(error).__name__ if error else None))

        def finished(self, record, error):
            self.events.append(("finished", record.seq, error is None))

        def close(self):
            self.closed = True

    return Recorder()


def observed_collectives(world):
    from ddpkit.comm import Comm, CommObserver

    comm = Comm.for_group()
    first, second = _recorder(), _recorder()
    comm.add_observer(first)
    comm.add_observer(second)
    comm.add_observer(first)  # once only
    base = comm.seq
    comm.all_reduce(torch.ones(2), "sync")
    pending = comm.all_reduce(torch.ones(3), "async", async_op=True)
    deadline = time.monotonic() + 20
    while not any(e[:2] == ("finished", base + 2) for e in first.events) and time.monotonic() < deadline:
        time.sleep(0.01)  # nobody waits: the completion must be reported all the same
    finished_unwaited = [e for e in first.events if e[:2] == ("finished", base + 2)]
    comm.wait(pending)
    comm.remove_observer(second)
    comm.barrier("seen by one")
    comm.remove_observer(first)
    comm.barrier("seen by none")

    class Explainer(CommObserver):
        def wait_ended(self, record, error):
            return ValueError(f"explained #{record.seq}") if error is not None else None

    comm.add_observer(Explainer())
    comm.add_observer(first)
    try:
        comm.broadcast(torch.ones(1), src=world.world_size + 3, what="bad source")  # fails on each rank alone
        replaced = "no error"
    except ValueError as exc:
        replaced = f"{exc} from {type(exc.__cause__).__name__}"
    comm.close_observers()
    return {"first": first.events, "second": second.events, "unwaited": finished_unwaited, "base": base,
            "replaced": replaced, "closed": first.closed, "left": list(comm.observers)}


def test_observers_see_every_event_in_order_and_async_completion_unwaited():
    for result in run_world(observed_collectives, 2):
        b = result["base"]
        events = result["first"]
        assert events[:4] == [("issued", b + 1, "all_reduce", "sync", 8), ("began", b + 1), ("ended", b + 1, None),
                              ("finished", b + 1, True)], events
        assert events[4] == ("issued", b + 2, "all_reduce", "async", 12), events
        # reported (from the backend's thread, or at once if it had completed already) before any wait began
        assert result["unwaited"] == [("finished", b + 2, True)], events
        assert events.index(("finished", b + 2, True)) < events.index(("began", b + 2))
        assert ("ended", b + 2, None) in events
        assert [e for e in events if e[1] == b + 3] == [("issued", b + 3, "barrier", "seen by one", 0),
                                                        ("began", b + 3), ("ended", b + 3, None),
                                                        ("finished", b + 3, True)]
        assert all(e[1] != b + 4 for e in events)  # removed: nothing of "seen by none"
        assert result["second"] == events[:events.index(("issued", b + 3, "barrier", "seen by one", 0))]
        assert result["replaced"].startswith(f"explained #{b + 5} from "), result["replaced"]
        assert events[-2][:3] == ("ended", b + 5, result["replaced"].split(" from ")[1])
        assert events[-1][:3] == ("finished", b + 5, False)
        assert result["closed"] and result["left"] == []


def test_a_world_of_one_numbers_collectives_and_tells_observers_of_them():
    from ddpkit.comm import Comm

    comm = Comm()  # no process group at all
    recorder = _recorder()
    comm.add_observer(recorder)
    tensor = torch.ones(2)
    assert comm.all_reduce(tensor, "loss") is None and comm.broadcast_object(7, what="x") == 7
    assert [e[:3] for e in recorder.events] == [("issued", 1, "all_reduce"), ("issued", 2, "broadcast_object")]
    assert [r.seq for r in comm.log] == [1, 2]
