"""ZeroRedundancyOptimizer (ZeRO stage 1, and stage 2's sharded gradients) against the unsharded optimizer and
single-process truth (stage 2's forward and refusals: test_zero_grads.py; checkpoints: test_zero_checkpoint.py).

Three runs on every rank of a gloo world, from the same initial weights and batches:
    plain   ddpkit's DDP + the unsharded optimizer
    zero    ddpkit's DDP + ZeroRedundancyOptimizer of the same class
    truth   one process on the concatenated batch (the mean over ranks of each rank's shard loss)
zero must equal plain bitwise after every step (same averaged gradients; an elementwise optimizer computes the
same per element on a slice), truth to 1e-6 (the gradient averages are summed in another order), and every
rank's replica must be bitwise rank 0's. Each optimizer step accumulates two micro-batches, the first under
no_sync.
"""

from __future__ import annotations

import functools
import hashlib
import time

import pytest
import torch

# The optimizers' first step imports torch._dynamo (about 3 s of CPU); imported here, once, every forked rank
# inherits it instead of importing it again (the ranks share two cores).
import torch._dynamo  # noqa: E402,F401
from torch import nn

from helpers import models
from helpers.world import run_world

SHARD = 3  # samples per rank per micro-batch
STEPS = 3
MICRO = 2
TOL = 1e-6


class TwoDtypes(nn.Module):
    """A float32 layer and a float64 gain: two units per param group."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(12, 5)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 5, dtype=torch.float64))

    def forward(self, x):
        return self.lin(x) * self.gain.float()


def _make(name):
    return TwoDtypes() if name == "twodtypes" else models.make(name)


def _loss(name, model, x, y, rank, step):
    return models.loss("mlp" if name == "twodtypes" else name, model, x, y, rank, step)


# eps=1e-4, not AdamW's 1e-8, only for the comparison with truth: the attention's key bias has a gradient that is
# mathematically zero (softmax ignores a shift of every score), so what it gets is rounding noise (~1e-9), which
# changes with the order of summation and which Adam with eps=1e-8 normalises into a full +-lr step (seen: 1e-4
# apart from truth after 3 steps, while zero and plain stay bitwise equal). eps=1e-4 keeps that noise at 1e-8.
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1, "eps": 1e-4}),
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
}


def _fingerprint(module):
    digest = hashlib.sha256()
    for tensor in module.parameters():
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _micro(name, step, micro, world_size):
    return models.micro("mlp" if name == "twodtypes" else name, step, micro, world_size, SHARD)


def _ddp_step(name, model, opt, step, rank, world_size):
    opt.zero_grad()
    shards = getattr(model, "_grad_shards", None)
    before = _live_storages() if shards is not None else None
    for micro in range(MICRO):
        x, y = _micro(name, step, micro, world_size)[rank]
        # Mean over micro-batches: the accumulated sum divided by their number.
        if micro < MICRO - 1:
            with model.no_sync():
                (_loss(name, model, x, y, rank, step) / MICRO).backward()
        else:
            (_loss(name, model, x, y, rank, step) / MICRO).backward()
    held = None
    if shards is not None:
        # What the wrapper says it holds (bucket storage + shards + .grad), and what gc finds: every tensor
        # storage alive now that was not before this step's forward, less the batch's. gloo's worker thread may
        # hold the last bucket's storage for a moment after its wait returned (torch keeps the Python tensor
        # alive while C++ refers to it): counted again until it settles, for at most a second.
        mine = shards.held_bytes()
        usage = 4 * len(list(model.parameters()))  # the usage flags: at most 4 bytes per parameter
        for _ in range(100):
            new = {key: n for key, n in _live_storages().items() if key not in before}
            for tensor in (x, y):
                new.pop((tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()), None)
            if abs(sum(new.values()) - mine) <= usage:
                break
            time.sleep(0.01)
        held = (mine, sum(new.values()))
    opt.step()
    if hasattr(opt, "wait_for_params"):
        opt.wait_for_params()  # stage 2 leaves the gathers in flight until the next forward
    return held


def _live_storages():
    """(data pointer, bytes) of the storage of every live tensor the garbage collector can see."""
    import gc

    gc.collect()  # cyclic garbage not yet collected is not held
    out = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            try:
                storage = obj.untyped_storage()
                out[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
            except (RuntimeError, NotImplementedError):
                continue  # a fake tensor left by an earlier torch.compile in the parent (forked) process: no memory
    return out


def _truth_step(name, model, opt, step, world_size):
    opt.zero_grad()
    for micro in range(MICRO):
        shards = _micro(name, step, micro, world_size)
        total = sum(_loss(name, model, x, y, r, step) for r, (x, y) in enumerate(shards))
        (total / (world_size * MICRO)).backward()
    opt.step()


def stage1_against_truth(world, opt_name, names, bucket_view):
    import gc

    import ddpkit
    import ddpkit.engine.partition

    # What this rank inherited from pytest (every test module, torch._dynamo) holds no tensor of this run: frozen,
    # _live_storages' collections and scans skip it (they took 30 of the 50 s of a 3-rank world). Every object
    # made from here on, the models, their gradients and the optimizers' state, is still collected and scanned.
    gc.freeze()

    if not bucket_view:  # 1 and 3 ranks: stage 1 in units of a parameter or two, each stepped and gathered alone
        ddpkit.engine.partition.CHUNK_BYTES = 256

    cls, kwargs = OPTIMIZERS[opt_name]
    out = {}
    for name in names:
        runs = {}
        for kind in KINDS:
            torch.manual_seed(0)
            module = _make(name)
            model = module if kind == "truth" else ddpkit.DistributedDataParallel(
                module, bucket_cap_mb=0.001, zero_stage=2 if kind == "zero2" else 0)
            if kind.startswith("zero"):
                opt = ddpkit.ZeroRedundancyOptimizer(model.parameters(), cls,
                                                     parameters_as_bucket_view=bucket_view, **kwargs)
            else:
                opt = cls(model.parameters(), **kwargs)
            runs[kind] = (module, model, opt)
        result = {kind: {"bitwise": [], "from_plain": [], "errors": [], "prints": [], "held": []}
                  for kind in ("zero", "zero2")}
        for step in range(STEPS):
            held = {kind: _ddp_step(name, runs[kind][1], runs[kind][2], step, world.rank, world.world_size)
                    for kind in ("plain", "zero", "zero2")}
            _truth_step(name, runs["truth"][0], runs["truth"][2], step, world.world_size)
            for kind in ("zero", "zero2"):
                params = list(runs[kind][0].parameters())
                got = result[kind]
                got["bitwise"].append(all(torch.equal(a, b) for a, b in zip(params, runs["plain"][0].parameters())))
                got["from_plain"].append(max((a.double() - b.double()).abs().max().item()
                                             for a, b in zip(params, runs["plain"][0].parameters())))
                got["errors"].append(max((a.double() - b.double()).abs().max().item()
                                         for a, b in zip(params, runs["truth"][0].parameters())))
                got["prints"].append(_fingerprint(runs[kind][0]))
                got["held"].append(held[kind])
        result["zero"]["state"] = _state_checks(runs, world)
        # Stage 2's shard is the rank-order sum (ddpkit.distributed.comm's pairwise reduce-scatter on gloo); DDP's all-reduce
        # sums in gloo's ring order, which is the same on 2 ranks only (a + b == b + a) but not on 3.
        result["zero2"]["same_as_plain"] = _consolidated_equal(runs["zero2"][2], runs["plain"][2], world,
                                                               exact=world.world_size <= 2)
        reducer = runs["zero2"][1].reducer
        result["zero2"]["buckets"] = len(reducer.buckets) if reducer is not None else 0
        result["param_bytes"] = sum(p.numel() * p.element_size() for p in runs["plain"][0].parameters()
                                    if p.grad is not None)
        result["bucket_bytes"] = max((b.layout.padded_numel * b.layout.dtype.itemsize for b in reducer.buckets),
                                     default=0) if reducer is not None else 0
        result["num_params"] = len(list(runs["plain"][0].parameters()))
        result["all_param_bytes"] = sum(p.numel() * p.element_size() for p in runs["plain"][0].parameters())
        out[name] = result
    return out


def _consolidated_equal(zero, plain, world, exact=True):
    zero.consolidate_state_dict(to=0)
    if world.rank != 0:
        with pytest.raises(RuntimeError, match="consolidate_state_dict"):
            zero.state_dict()
        return None
    mine, theirs = zero.state_dict(), plain.state_dict()
    same = torch.equal if exact else functools.partial(torch.allclose, rtol=1e-5, atol=TOL)
    return mine["param_groups"] == theirs["param_groups"] and mine["state"].keys() == theirs["state"].keys() \
        and all(same(mine["state"][i][k], v) for i, s in theirs["state"].items() for k, v in s.items())


def _state_checks(runs, world):
    """Consolidated state equals the plain optimizer's; loading it back and stepping stays bitwise."""
    zero, plain = runs["zero"][2], runs["plain"][2]
    same = _consolidated_equal(zero, plain, world)
    # The unsharded optimizer's own state dict loads into the shards (a fresh partition of a fresh optimizer).
    import ddpkit

    module = runs["zero"][0]
    fresh = ddpkit.ZeroRedundancyOptimizer(module.parameters(), type(plain), **{
        k: v for k, v in plain.defaults.items() if k in ("lr", "weight_decay", "momentum", "eps")})
    fresh.load_state_dict(plain.state_dict())
    roundtrip = all(torch.equal(a[3][k], b[3][k]) for a, b in zip(fresh.shard_state(), zero.shard_state())
                    for k in a[3]) and len(fresh.shard_state()) == len(zero.shard_state())
    return {"same_as_plain": same, "roundtrip": roundtrip, "bytes": zero.state_bytes(),
            "plain_bytes": _elementwise_bytes(plain), "elementwise_bytes": _elementwise_bytes(zero.optim),
            "units": len(zero.units)}


def _elementwise_bytes(opt):
    return sum(v.numel() * v.element_size() for state in opt.state.values() for k, v in state.items()
               if isinstance(v, torch.Tensor) and k != "step")


KINDS = ("plain", "zero", "zero2", "truth")
NAMES = ("mlp", "transformer", "convbn", "branchy", "twodtypes")


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_stage1_matches_plain_optimizer_and_truth(world_size, opt_name):
    results = run_world(stage1_against_truth, world_size, args=(opt_name, NAMES, world_size == 2),
                        deadline_s=240)
    for name in NAMES:
        for kind in ("zero", "zero2"):
            per_rank = [r[name][kind] for r in results]
            what = f"{name}, {'stage 1' if kind == 'zero' else 'stage 2'} on {world_size} ranks"
            for rank, got in enumerate(per_rank):
                if kind == "zero" or world_size <= 2:  # on 3 ranks stage 2 sums in another order than DDP
                    assert all(got["bitwise"]), f"{what}, rank {rank}: differs from DDP + {opt_name}: {got['bitwise']}"
                assert max(got["from_plain"]) <= TOL, f"{what}, rank {rank}: {got['from_plain']} from DDP"
                assert max(got["errors"]) <= TOL, f"{what}, rank {rank}: {got['errors']} from single-process truth"
                assert got["prints"] == per_rank[0]["prints"], f"{what}: rank {rank}'s replica differs from rank 0's"
            assert per_rank[0]["same_as_plain"] if kind == "zero2" else per_rank[0]["state"]["same_as_plain"], \
                f"{what}: consolidated state != {opt_name}'s state_dict"
        stage1 = [r[name]["zero"]["state"] for r in results]
        assert all(s["roundtrip"] for s in stage1), f"{name}: load_state_dict(plain) != the trained shards"
        _assert_balanced(name, stage1, world_size)
        _assert_gradients_sharded(name, [r[name]["zero2"] for r in results], results[0][name], world_size)


def _assert_gradients_sharded(name, per_rank, result, world_size):
    """Stage 2: after backward a rank holds total / N bytes of gradient storage (bucket storage, shards and
    .grad together), give or take one bucket (here: the padding of each bucket's last shards, under N elements
    per bucket, since every bucket's storage is released once its shard is taken); and the garbage collector
    finds no more new tensor storage than that, give or take the usage flags (at most 4 bytes per parameter)."""
    if world_size == 1:  # a world of one has no reducer and keeps .grad as it is
        return
    # Every parameter has its slice in the shards, used or not (branchy's never-used head: zeros).
    total = result["all_param_bytes"]
    slack = per_rank[0]["buckets"] * world_size * 8
    assert slack < result["bucket_bytes"], "the slack must be under one bucket"
    for rank, got in enumerate(per_rank):
        for step, (held, found) in enumerate(got["held"]):
            what = f"{name} rank {rank} step {step}: {held} bytes of gradient after backward"
            assert abs(found - held) <= 4 * result["num_params"], f"{what}, but gc finds {found} new bytes"
            assert abs(held - total / world_size) <= slack, f"{what}, total / N = {total / world_size:.0f}"


def test_chunk_positions():
    from ddpkit.engine.partition import chunk_positions

    params = [torch.zeros(n) for n in (10, 1, 30, 2, 2, 100)]  # 4 bytes each element
    assert chunk_positions(params, [0, 1, 2, 3, 4, 5], 40) == [[0], [1, 2], [3, 4, 5]]
    assert chunk_positions(params, [5, 1, 3], 1000) == [[5, 1, 3]]
    assert chunk_positions(params, [], 40) == []


def _assert_balanced(name, states, world_size):
    """Per rank total/N, give or take the padding of each unit's last segments (under N elements per unit)."""
    total = states[0]["plain_bytes"]
    got = [s["elementwise_bytes"] for s in states]
    assert sum(got) == total, f"{name}: shards hold {sum(got)} bytes of state, the unsharded optimizer {total}"
    if name == "branchy":
        return  # its never-used head has no state on its owner: the shards are equal in elements, not in state
    per_element = 16 if name == "twodtypes" else 8  # two float32 (AdamW) or one (SGD) ... at most two float64
    slack = states[0]["units"] * world_size * per_element
    for rank, n in enumerate(got):
        assert abs(n - total / world_size) <= slack, \
            f"{name} rank {rank}: {n} bytes of state, {total / world_size:.0f} = total / {world_size} expected"


def surface_checks(world):
    """torch's DDP underneath, a shape-aware optimizer, add_param_group, clipping, and the refusals."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import ddpkit

    out = {}
    for label, wrap, cls, kwargs in (
            ("torch ddp", TorchDDP, torch.optim.AdamW, {"lr": 1e-2}),
            ("adafactor", ddpkit.DistributedDataParallel, torch.optim.Adafactor, {"lr": 1e-2}),
            ("clip", ddpkit.DistributedDataParallel, torch.optim.SGD, {"lr": 0.1})):
        runs = []
        for zero in (False, True):
            torch.manual_seed(0)
            module = models.make("mlp")
            model = wrap(module)
            extra = list(module.net[4].parameters())
            first = [p for p in module.parameters() if all(p is not q for q in extra)]
            opt = (ddpkit.ZeroRedundancyOptimizer(first, cls, **kwargs) if zero else cls(first, **kwargs))
            opt.add_param_group({"params": extra, "lr": kwargs["lr"] / 2})
            runs.append((module, model, opt))
        norms = []
        for step in range(STEPS):
            for (module, model, opt), zero in zip(runs, (False, True)):
                opt.zero_grad()
                x, y = _micro("mlp", step, 0, world.world_size)[world.rank]
                _loss("mlp", model, x, y, world.rank, step).backward()
                if label == "clip":
                    clip = opt.clip_grad_norm_ if zero else \
                        (lambda m, o=opt: torch.nn.utils.clip_grad_norm_(
                            [p for g in o.param_groups for p in g["params"]], m))
                    norms.append(float(clip(0.05)))
                opt.step()
        params = [list(module.parameters()) for module, _, _ in runs]
        out[label] = {"bitwise": all(torch.equal(a, b) for a, b in zip(*params)),
                      "error": max((a - b).abs().max().item() for a, b in zip(*params)),
                      "norms": norms, "print": _fingerprint(runs[1][0]),
                      "shapes": [tuple(p.shape) for g in runs[1][2].optim.param_groups for p in g["params"]],
                      "whole": runs[1][2].whole}
    out["step kwargs"] = _step_kwargs_and_new_keys()
    for bad, match in (({"optimizer_class": torch.optim.LBFGS}, "LBFGS"),
                       ({"optimizer_class": torch.optim.SGD, "overlap_with_ddp": True}, "zero_stage=2")):
        with pytest.raises(ValueError, match=match):
            ddpkit.ZeroRedundancyOptimizer(models.make("mlp").parameters(), lr=0.1, **bad)
    sparse = torch.nn.Parameter(torch.sparse_coo_tensor(torch.tensor([[0, 3]]), torch.tensor([1.0, 2.0]), (8,)))
    with pytest.raises(ValueError, match="dense parameters"):  # torch's type (a RuntimeError from deep inside)
        ddpkit.ZeroRedundancyOptimizer([torch.ones(1, requires_grad=True), sparse], torch.optim.SGD, lr=0.1)
    opt = ddpkit.ZeroRedundancyOptimizer([torch.ones(1, requires_grad=True)], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="dense parameters"):
        opt.add_param_group({"params": [sparse]})
    assert len(opt.param_groups) == len(opt.optim.param_groups) == 1
    return out


class _CountingSGD(torch.optim.SGD):
    """An optimizer with a step keyword of its own that writes a key of its own into its first group."""

    def step(self, closure=None, calls=None):
        super().step()
        if calls is not None:
            calls.append(1)
        self.param_groups[0]["seen"] = self.param_groups[0].get("seen", 0) + 1


def _step_kwargs_and_new_keys():
    """torch's: step(**kwargs) reaches the wrapped optimizer's step, once per step() on every rank (here one
    rank owns nothing of the first group), and keys its step writes show in the caller's param_groups."""
    import ddpkit

    one, four = torch.ones(1, requires_grad=True), torch.ones(4, requires_grad=True)
    opt = ddpkit.ZeroRedundancyOptimizer([{"params": [one]}, {"params": [four]}], _CountingSGD, lr=0.1)
    calls = []
    for step in range(3):
        one.grad, four.grad = torch.ones(1), torch.ones(4)
        opt.step(calls=calls) if step < 2 else opt.step()
    return {"calls": len(calls), "values": one.tolist() + four.tolist(), "seen": opt.param_groups[0].get("seen")}


@pytest.mark.parametrize("world_size", [1, 2])
def test_surface_torch_ddp_adafactor_clip(world_size):
    results = run_world(surface_checks, world_size, deadline_s=180)
    for rank, got in enumerate(results):
        assert got["torch ddp"]["bitwise"], "under torch's DDP, ZeRO differs from the plain AdamW"
        assert got["adafactor"]["bitwise"] and got["adafactor"]["whole"], "whole-parameter Adafactor differs"
        shapes = got["adafactor"]["shapes"]  # what Adafactor steps on this rank: whole, shaped parameters
        assert any(len(shape) == 2 for shape in shapes), shapes
        assert set(shapes) <= {tuple(p.shape) for p in models.make("mlp").parameters()}, shapes
        # Clipping: the norm from the shards equals torch's on the whole gradient (to rounding: the squares are
        # summed in another order), and so does the clipped step.
        norms = got["clip"]["norms"]
        plain, sharded = norms[0::2], norms[1::2]
        assert all(abs(a - b) <= 1e-6 * max(a, 1.0) for a, b in zip(plain, sharded)), (plain, sharded)
        assert min(plain) > 0.05, "the test must clip: every norm above max_norm"
        assert got["clip"]["error"] <= TOL, got["clip"]["error"]
        step = got.pop("step kwargs")
        assert step["calls"] == 2 and step["seen"] == 3, step
        assert step["values"] == pytest.approx([0.7] * 5, abs=1e-6), step
        for label in got:
            assert got[label]["print"] == results[0][label]["print"], f"{label}: rank {rank}'s replica differs"
