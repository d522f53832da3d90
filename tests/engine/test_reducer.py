"""The bucket plan, the ready order and bucket layouts (pure functions), and the reductions on spawned ranks."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpkit.engine.reducer import ParamSpec, assign_buckets, ready_order

CPU = torch.device("cpu")
MIB = 1024 * 1024


def spec(numel: int, dtype: torch.dtype = torch.float32, device: torch.device = CPU) -> ParamSpec:
    return ParamSpec(numel, torch.empty((), dtype=dtype).element_size(), dtype, device)


def test_reverse_order_caps_and_small_first_bucket():
    # Ten 1 MiB float32 tensors, registered 0..9; backward makes 9 ready first.
    specs = [spec(MIB // 4) for _ in range(10)]
    plan = assign_buckets(specs, list(reversed(range(10))), cap_bytes=3 * MIB, first_cap_bytes=1 * MIB)
    assert plan == [[9], [8, 7, 6], [5, 4, 3], [2, 1, 0]]


def test_a_bucket_closes_once_it_reaches_its_cap():
    # The 40 KB tensor takes the first bucket past its 1000 bytes: it closes right after it (torch's rule).
    specs = [spec(10), spec(10_000), spec(10)]
    plan = assign_buckets(specs, [2, 1, 0], cap_bytes=1000, first_cap_bytes=1000)
    assert plan == [[2, 1], [0]]


def test_small_first_bucket_still_overlaps_a_large_model():
    # Registration order: 2048x512, 2048, 2048x2048, 2048, 512x2048, 512, 10x512, 10 (bench's MLP).
    shapes = [2048 * 512, 2048, 2048 * 2048, 2048, 512 * 2048, 512, 10 * 512, 10]
    plan = assign_buckets([spec(n) for n in shapes], list(reversed(range(8))), cap_bytes=25 * MIB,
                        first_cap_bytes=1 * MIB)
    assert plan == [[7, 6, 5, 4], [3, 2, 1, 0]]  # what torch builds too


def test_dtypes_and_devices_never_share_a_bucket():
    meta = torch.device("meta")
    specs = [spec(4), spec(4, torch.float16), spec(4), spec(4, device=meta), spec(4, torch.float16)]
    plan = assign_buckets(specs, [4, 3, 2, 1, 0], cap_bytes=MIB)
    assert plan == [[4, 1], [3], [2, 0]]


def test_bad_arguments():
    with pytest.raises(ValueError, match="positive"):
        assign_buckets([spec(1)], [0], cap_bytes=0)
    with pytest.raises(ValueError, match="permutation"):
        assign_buckets([spec(1), spec(1)], [0, 0], cap_bytes=10)


kinds = st.sampled_from([(torch.float32, CPU), (torch.float16, CPU), (torch.float32, torch.device("meta"))])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5000), kinds), min_size=1, max_size=40), st.randoms(),
       st.integers(4, 40_000), st.integers(1, 40_000))
def test_plan_properties(params, rnd, cap, first_cap):
    specs = [spec(n, dtype, device) for n, (dtype, device) in params]
    order = list(range(len(specs)))
    rnd.shuffle(order)
    plan = assign_buckets(specs, order, cap_bytes=cap, first_cap_bytes=first_cap)
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


# -- bucket layouts and shards: pure ----------------------------------------------------------------------------
def test_layout_pads_to_equal_shards_and_maps_them_back():
    from ddpkit.engine.buckets import ShardPiece, layout_buckets

    (layout,) = layout_buckets([[2, 0]], [spec(3), spec(1), spec(4)], shards=3)
    assert layout.members == (2, 0) and layout.offsets == (0, 4) and layout.numel == 7
    assert layout.shard_numel == 3 and layout.padded_numel == 9  # two zeros of padding at the end
    assert layout.shard_pieces(0) == [ShardPiece(2, 0, 3, 0)]
    assert layout.shard_pieces(1) == [ShardPiece(2, 3, 4, 0), ShardPiece(0, 0, 2, 1)]
    assert layout.shard_pieces(2) == [ShardPiece(0, 2, 3, 0)]  # then padding


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=12), st.integers(1, 9))
def test_shards_cover_every_element_once(numels, shards):
    from ddpkit.engine.buckets import layout_buckets

    specs = [spec(n) for n in numels]
    (layout,) = layout_buckets([list(reversed(range(len(specs))))], specs, shards=shards)
    assert layout.padded_numel % shards == 0 and 0 <= layout.padded_numel - layout.numel < shards
    flat = torch.arange(layout.padded_numel)
    rebuilt = {i: torch.full((n,), -1) for i, n in enumerate(numels)}
    for rank in range(shards):
        lo, hi = layout.shard_range(rank)
        shard = flat[lo:hi]
        for piece in layout.shard_pieces(rank):
            part = rebuilt[piece.param][piece.start:piece.stop]
            assert (part == -1).all(), "an element is in two shards"
            part.copy_(shard[piece.shard_offset:piece.shard_offset + piece.stop - piece.start])
    for i, offset in zip(layout.members, layout.offsets):
        assert torch.equal(rebuilt[i], torch.arange(offset, offset + numels[i]))


def test_a_window_starts_clean():
    from ddpkit.engine.backward_pass import Uses, BackwardPass

    backward_pass = BackwardPass(graph_task=7)
    assert backward_pass.open and not backward_pass.sync and backward_pass.usage is None
    backward_pass.open_sync(3, [], divisor=2.0, number=1)
    assert backward_pass.fires == [0, 0, 0] and backward_pass.filled == [False] * 3 and backward_pass.divisor == 2.0
    uses = Uses(3)
    uses.mark(1)
    uses.mark(1)
    assert uses.flags == [False, True, False] and uses.count == 1


# -- the reductions, on spawned ranks ---------------------------------------------------------------------------
class _Gated(torch.nn.Module):
    """A layer, a gate only rank 0 uses, and a layer only rank 0 uses from the third step on."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(5, 7)
        self.gate = torch.nn.Parameter(torch.linspace(0.5, 1.5, 7))
        self.late = torch.nn.Linear(7, 7)

    def forward(self, x, rank, step):
        h = torch.tanh(self.lin(x))
        if rank == 0:
            h = h * self.gate
        return h + self.late(h) if rank == 0 and step == 2 else h


def _grads_against_one_process(ref, copies, n):
    """(name, ok) per parameter: the all-reduce's average, divisor=1's sum and bfloat16's average against one
    process's gradients of the mean loss."""
    checks = []
    for (name, p), q, s, b in zip(ref.named_parameters(), copies["allreduce"].parameters(),
                                  copies["sum"].parameters(), copies["bf16"].parameters()):
        if p.grad is None:  # no rank used it: None stays None
            checks.append((name, q.grad is None and s.grad is None and b.grad is None))
            continue
        checks.append((name + " bf16", b.grad is not None and
                       torch.allclose(b.grad.float(), p.grad, rtol=0.02, atol=0.02)))
        checks.append((name, (p.grad - q.grad).abs().max().item() <= 1e-6))
        checks.append((name + " sum", (s.grad - n * q.grad).abs().max().item() <= 1e-6))
    return checks


def _shards_against_the_average(key, red, kept, averaged, r, n):
    """(what, ok): each bucket's shard, as handed over, is this rank's slice of the all-reduce's average."""
    # The shard is all a reduce-scatter keeps: each bucket's storage is released after backward.
    checks = [(f"{key} storage released", not any(b.allocated for b in red.buckets)),
              (f"{key} holds no output", not red.reduction.held())]
    for bucket, layout in zip(red.buckets, red.layouts()):
        shard = kept[bucket.index]
        assert shard.numel() == layout.shard_numel
        covered = 0
        for piece in layout.shard_pieces(r):
            grad = averaged[piece.param]
            got = shard[piece.shard_offset:piece.shard_offset + piece.stop - piece.start]
            want = torch.zeros_like(got) if grad is None else grad.flatten()[piece.start:piece.stop]
            # Two ranks sum in one order only (a + b == b + a): the pairwise shard is the all-reduce's bits.
            exact = torch.equal(got, want) if key == "rs_pairwise" and n == 2 else \
                torch.allclose(got, want, atol=1e-7)
            checks.append((f"{key} bucket {bucket.index} param {piece.param}", exact))
            covered += piece.stop - piece.start
        checks.append((f"{key} padding", bool((shard[covered:] == 0).all())))
    return checks


def _create_graph_divides_alike(comm, r):
    """A gradient large enough to be divided in its hook, made with create_graph=True (it requires grad
    itself), averages to the same bits as one made without."""
    import copy

    from ddpkit.engine.reducer import Reducer

    torch.manual_seed(1)
    big = torch.nn.Linear(256, 200)
    twin = copy.deepcopy(big)
    for model, create_graph in ((big, False), (twin, True)):
        Reducer(list(model.parameters()), ["weight", "bias"], comm)
        for step in range(2):
            model.zero_grad(set_to_none=True)
            x = torch.randn(3, 256, generator=torch.Generator().manual_seed(10 * step + r))
            model(x).pow(2).sum().backward(create_graph=create_graph)
    return all(torch.equal(p.grad, q.grad.detach()) for p, q in zip(big.parameters(), twin.parameters()))


def reductions(world):
    import copy

    from ddpkit.distributed.comm import Comm
    from ddpkit.engine.reducer import Reducer
    from ddpkit.engine.reductions import ReduceScatter

    comm, r, n = Comm.for_group(None), world.rank, world.world_size
    gloo = Comm(None)  # gloo's own reduce_scatter_tensor, where comm composes one from point-to-point sends
    gloo.pairwise = False
    torch.manual_seed(0)
    ref = _Gated()
    copies = {k: copy.deepcopy(ref) for k in ("allreduce", "sum", "rs_pairwise", "rs_gloo", "bf16", "caps")}
    copies["bf16"].to(torch.bfloat16)  # its usage flags ride in a bfloat16 bucket: sums of 0 and 1 stay exact
    seen: dict[str, list] = {"rs_pairwise": [], "rs_gloo": []}
    kept: dict[str, dict] = {"rs_pairwise": {}, "rs_gloo": {}}  # the latest shard of each bucket, as handed over

    def on_shard(key, bucket, shard, used):
        seen[key].append((bucket.index, used))
        kept[key][bucket.index] = shard

    def reducer(key, **kwargs):
        named = list(copies[key].named_parameters())
        return Reducer([p for _, p in named], [m for m, _ in named], comm, bucket_cap_mb=0.0001, **kwargs)

    reducers = {"allreduce": reducer("allreduce"), "sum": reducer("sum", divisor=1.0), "bf16": reducer("bf16")}
    # Another bucket_cap_mb on the other ranks: rank 0's buckets, as torch's DDP takes them (gloo aborted before).
    named = list(copies["caps"].named_parameters())
    reducers["caps"] = Reducer([p for _, p in named], [m for m, _ in named], comm,
                               bucket_cap_mb=0.0001 if r == 0 else 25.0)
    for key, via in (("rs_pairwise", comm), ("rs_gloo", gloo)):
        reducers[key] = reducer(key, reduction=ReduceScatter(via, on_shard=functools.partial(on_shard, key)))
    out = {"errors": []}
    for step in range(3):
        x = torch.randn(2 * n, 5, generator=torch.Generator().manual_seed(step))
        for model in [ref, *copies.values()]:
            model.zero_grad(set_to_none=True)
        for key, model in copies.items():
            mine = x[2 * r:2 * r + 2]
            model(mine.to(torch.bfloat16) if key == "bf16" else mine, r, step).sum().backward()
        (sum(ref(x[2 * k:2 * k + 2], k, step).sum() for k in range(n)) / n).backward()
        out["errors"] += _grads_against_one_process(ref, copies, n)
        out["errors"] += [(f"caps {name}", (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad))
                          for (name, p), q in zip(copies["caps"].named_parameters(),
                                                  copies["allreduce"].parameters())]
        averaged = {i: p.grad for i, p in enumerate(copies["allreduce"].parameters())}
        for key in ("rs_pairwise", "rs_gloo"):
            out["errors"] += _shards_against_the_average(key, reducers[key], kept[key], averaged, r, n)
    out["usage"] = [rec.what for rec in comm.log if rec.what.startswith("parameter usage")]  # (the log keeps 64)
    out["errors"].append(("create_graph", _create_graph_divides_alike(comm, r)))
    out["errors"].append(("all-reduce keeps its storage", all(b.allocated for b in reducers["allreduce"].buckets)))
    out["storage"] = [(b.storage.numel(), b.layout.numel) for b in reducers["allreduce"].buckets]
    out["seen"] = seen
    out["rank"] = r
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_reductions_against_the_all_reduce(world_size):
    """Reduce-scatter shards (comm's pairwise one and gloo's own collective) hold exactly this rank's slice
    of the average; divisor=1 sums; the usage flags travel with the last bucket wherever the collective can
    carry them, and a parameter no rank used stays None."""
    from helpers.world import run_world

    for res in run_world(reductions, world_size):
        bad = [name for name, ok in res["errors"] if not ok]
        assert not bad, bad
        # The all-reduce's usage flags ride after its last bucket's gradients, one per parameter (5), nowhere else.
        assert [total - numel for total, numel in res["storage"]] == [0] * (len(res["storage"]) - 1) + [5], res
        # The pairwise reduce-scatter sends them beside the shards; gloo's own cannot carry them: one usage
        # collective per synchronised backward, for that reducer alone, named after it.
        assert res["usage"] == [f"parameter usage, backward {k}" for k in (1, 2, 3)], res["usage"]
        for key in ("rs_pairwise", "rs_gloo"):
            calls = res["seen"][key]
            per_window = len({index for index, _ in calls})
            assert len(calls) == 3 * per_window, "on_shard runs once per bucket per synchronised backward"
            # The gate (parameter 2) is used on rank 0 only, so somewhere; late.* (3, 4) nowhere until step 2,
            # where rank 0 used every parameter (and so needs no counts: None) and the other ranks did not.
            assert calls[per_window][1] == [True, True, True, False, False], calls[per_window]
            assert calls[-1][1] == (None if res["rank"] == 0 else [True] * 5), calls[-1]
