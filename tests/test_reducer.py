"""The bucket plan and the ready order: pure functions, no processes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpkit.reducer import ParamSpec, plan_buckets, ready_order

CPU = torch.device("cpu")
MIB = 1024 * 1024


def spec(numel: int, dtype: torch.dtype = torch.float32, device: torch.device = CPU) -> ParamSpec:
    return ParamSpec(numel, torch.empty((), dtype=dtype).element_size(), dtype, device)


def test_reverse_order_caps_and_small_first_bucket():
    # Ten 1 MiB float32 tensors, registered 0..9; backward makes 9 ready first.
    specs = [spec(MIB // 4) for _ in range(10)]
    plan = plan_buckets(specs, list(reversed(range(10))), cap_bytes=3 * MIB, first_cap_bytes=1 * MIB)
    assert plan == [[9], [8, 7, 6], [5, 4, 3], [2, 1, 0]]


def test_a_bucket_closes_once_it_reaches_its_cap():
    # The 40 KB tensor takes the first bucket past its 1000 bytes: it closes right after it (torch's rule).
    specs = [spec(10), spec(10_000), spec(10)]
    plan = plan_buckets(specs, [2, 1, 0], cap_bytes=1000, first_cap_bytes=1000)
    assert plan == [[2, 1], [0]]


def test_small_first_bucket_still_overlaps_a_large_model():
    # Registration order: 2048x512, 2048, 2048x2048, 2048, 512x2048, 512, 10x512, 10 (bench's MLP).
    shapes = [2048 * 512, 2048, 2048 * 2048, 2048, 512 * 2048, 512, 10 * 512, 10]
    plan = plan_buckets([spec(n) for n in shapes], list(reversed(range(8))), cap_bytes=25 * MIB,
                        first_cap_bytes=1 * MIB)
    assert plan == [[7, 6, 5, 4], [3, 2, 1, 0]]  # what torch builds too


def test_dtypes_and_devices_never_share_a_bucket():
    meta = torch.device("meta")
    specs = [spec(4), spec(4, torch.float16), spec(4), spec(4, device=meta), spec(4, torch.float16)]
    plan = plan_buckets(specs, [4, 3, 2, 1, 0], cap_bytes=MIB)
    assert plan == [[4, 1], [3], [2, 0]]


def test_bad_arguments():
    with pytest.raises(ValueError, match="positive"):
        plan_buckets([spec(1)], [0], cap_bytes=0)
    with pytest.raises(ValueError, match="permutation"):
        plan_buckets([spec(1), spec(1)], [0, 0], cap_bytes=10)


kinds = st.sampled_from([(torch.float32, CPU), (torch.float16, CPU), (torch.float32, torch.device("meta"))])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5000), kinds), min_size=1, max_size=40), st.randoms(),
       st.integers(4, 40_000), st.integers(1, 40_000))
def test_plan_properties(params, rnd, cap, first_cap):
    specs = [spec(n, dtype, device) for n, (dtype, device) in params]
    order = list(range(len(specs)))
    rnd.shuffle(order)
    plan = plan_buckets(specs, order, cap_bytes=cap, first_cap_bytes=first_cap)
    flat = [i for bucket in plan for i in bucket]
    assert sorted(flat) == list(range(len(specs)))  # every parameter exactly once
    position = {index: pos for pos, index in enumerate(order)}
    firsts = [position[bucket[0]] for bucket in plan]
    assert firsts == sorted(firsts)  # buckets numbered by readiness
    first_of_kind = set()
    for bucket in plan:
        kind = {(specs[i].dtype, specs[i].device) for i in bucket}
        assert len(kind) == 1  # one dtype and device per bucket
        assert [position[i] for i in bucket] == sorted(position[i] for i in bucket)  # ready order inside
        limit = cap if kind <= first_of_kind else min(cap, first_cap)
        first_of_kind |= kind
        # A bucket closes once it reaches its limit: without its last parameter it was below it.
        assert sum(specs[i].nbytes for i in bucket[:-1]) < limit


def test_ready_order_uses_last_firing_and_puts_unused_last():
    # 2 fired twice (reentrant checkpointing): it is ready at its second firing.
    assert ready_order([3, 2, 4, 2], num_params=6) == [3, 4, 2, 5, 1, 0]
    assert ready_order([], num_params=3) == [2, 1, 0]
