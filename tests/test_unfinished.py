"""The stall inspector where a wait returns before its collective completed (NCCL's, on the GPU): the collectives
the device has not completed (ddpkit.unfinished)."""

from __future__ import annotations


class _Record:
    def __init__(self, seq, op="all_reduce", what="", device="cuda:0"):
        self.seq, self.op, self.what, self.device = seq, op, what, device


def test_unfinished_counts_what_completed_and_names_the_oldest_collective_left():
    from ddpkit.unfinished import Unfinished

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
