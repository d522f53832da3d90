"""Who owns which elements (ddpkit.engine.partition): pure logic, no processes. Every parameter's elements are owned
exactly once, and a parameter of 0 elements has exactly one piece (of 0 elements), so that one rank's optimizer
keeps its state as the unsharded optimizer does."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from ddpkit.engine.buckets import BucketLayout
from ddpkit.engine.partition import Piece, partition_flat, partition_whole, place_empty
from ddpkit.engine.sharded_grads import unit_plan


def _check(plan, numels):
    """Each parameter's pieces cover [0, n) once, in order (a parameter of 0 elements: one piece (0, 0)); each
    segment's pieces lie inside it, in offset order."""
    for index, (n, ranges) in enumerate(zip(numels, plan.owner_ranges())):
        spans = [(start, stop) for _, start, stop in ranges]
        if n == 0:
            assert spans == [(0, 0)], (index, spans)
        else:
            assert spans[0][0] == 0 and spans[-1][1] == n and all(a < b for a, b in spans), (index, spans)
            assert all(b == c for (_, b), (c, _) in zip(spans, spans[1:])), (index, spans)
    for segment in plan.segments:
        assert list(segment) == sorted(segment, key=lambda p: (p.offset, p.param)), segment
        assert all(p.offset + p.numel <= plan.segment_numel for p in segment), segment


@given(numels=st.lists(st.integers(0, 9), max_size=8), world_size=st.integers(1, 4))
def test_every_element_has_one_owner_and_every_empty_parameter_one_piece(numels, world_size):
    for plan in (partition_flat(numels, world_size), partition_whole(numels, world_size)):
        _check(plan, numels)
    flat = partition_flat(numels, world_size)
    for index, n in enumerate(numels):  # a flat plan puts it where its elements would begin
        if n == 0 and flat.segment_numel:
            at = sum(numels[:index])
            rank = min(at // flat.segment_numel, world_size - 1)
            assert Piece(index, 0, 0, at - rank * flat.segment_numel) in flat.segments[rank], (index, flat)


def test_empty_parameters_go_where_their_elements_would_begin():
    plan = partition_flat([0, 5, 0, 3, 0], 2)  # 4 elements a rank: [p1 0:4] and [p1 4:5, p3]
    assert plan.segments == ((Piece(0, 0, 0, 0), Piece(1, 0, 4, 0)),
                             (Piece(1, 4, 5, 0), Piece(2, 0, 0, 1), Piece(3, 0, 3, 1), Piece(4, 0, 0, 4)))
    assert partition_flat([0, 0], 3).segments == ((Piece(0, 0, 0, 0), Piece(1, 0, 0, 0)), (), ())
    # Whole parameters: the least loaded rank, as any other parameter
    assert partition_whole([4, 0, 2], 2).segments == ((Piece(0, 0, 4, 0),), (Piece(1, 0, 0, 0), Piece(2, 0, 2, 0)))


def test_a_stage_2_bucket_gives_its_empty_member_a_piece():
    """Stage 2's units are the reducer's buckets (zero_grads.unit_plan), whose shards leave out a member of 0
    elements; place_empty gives it to the rank whose shard holds the bucket's next element."""
    layout = BucketLayout(0, (5, 6, 7, 8), (3, 0, 4, 0), torch.float32, torch.device("cpu"), shards=2)
    plan = place_empty(unit_plan(layout))
    _check(plan, layout.numels)
    assert plan.segments == ((Piece(0, 0, 3, 0), Piece(1, 0, 0, 3), Piece(2, 0, 1, 3)),
                             (Piece(2, 1, 4, 0), Piece(3, 0, 0, 3)))
    assert place_empty(plan) is plan  # nothing left to place
