"""ZeroRedundancyOptimizer (ZeRO stage 1) against the unsharded optimizer and single-process truth.

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
import os
import time

import pytest
import torch
from torch import nn

import models
from spawn import run_world

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


def _batch(name, n, seed):
    return models.batch("mlp" if name == "twodtypes" else name, n, seed)


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
    x, y = _batch(name, SHARD * world_size, seed=100 * step + micro)
    return [(x[r * SHARD:(r + 1) * SHARD], y[r * SHARD:(r + 1) * SHARD]) for r in range(world_size)]


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
        usage = 4 * len(list(model.parameters()))  # the usage counts, an int32 per parameter
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
            storage = obj.untyped_storage()
            out[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
    return out


def _truth_step(name, model, opt, step, world_size):
    opt.zero_grad()
    for micro in range(MICRO):
        shards = _micro(name, step, micro, world_size)
        total = sum(_loss(name, model, x, y, r, step) for r, (x, y) in enumerate(shards))
        (total / (world_size * MICRO)).backward()
    opt.step()


def stage1_against_truth(world, opt_name, names, bucket_view):
    import ddpkit
    import ddpkit.zero_partition

    if not bucket_view:  # 1 and 3 ranks: stage 1 in units of a parameter or two, each stepped and gathered alone
        ddpkit.zero_partition.CHUNK_BYTES = 256

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
        result = {kind: {"bitwise": [], "errors": [], "prints": [], "held": []} for kind in ("zero", "zero2")}
        for step in range(STEPS):
            held = {kind: _ddp_step(name, runs[kind][1], runs[kind][2], step, world.rank, world.world_size)
                    for kind in ("plain", "zero", "zero2")}
            _truth_step(name, runs["truth"][0], runs["truth"][2], step, world.world_size)
            for kind in ("zero", "zero2"):
                params = list(runs[kind][0].parameters())
                got = result[kind]
                got["bitwise"].append(all(torch.equal(a, b) for a, b in zip(params, runs["plain"][0].parameters())))
                got["errors"].append(max((a.double() - b.double()).abs().max().item()
                                         for a, b in zip(params, runs["truth"][0].parameters())))
                got["prints"].append(_fingerprint(runs[kind][0]))
                got["held"].append(held[kind])
        result["zero"]["state"] = _state_checks(runs, world)
        result["zero2"]["same_as_plain"] = _consolidated_equal(runs["zero2"][2], runs["plain"][2], world)
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


def _consolidated_equal(zero, plain, world):
    zero.consolidate_state_dict(to=0)
    if world.rank != 0:
        with pytest.raises(RuntimeError, match="consolidate_state_dict"):
            zero.state_dict()
        return None
    mine, theirs = zero.state_dict(), plain.state_dict()
    return mine["param_groups"] == theirs["param_groups"] and mine["state"].keys() == theirs["state"].keys() \
        and all(torch.equal(mine["state"][i][k], v) for i, s in theirs["state"].items() for k, v in s.items())


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
                assert all(got["bitwise"]), f"{what}, rank {rank}: differs from DDP + {opt_name}: {got['bitwise']}"
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
    finds no more new tensor storage than that, give or take the usage counts (4 bytes per parameter)."""
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
    from ddpkit.zero_partition import chunk_positions

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
    import ddpkit
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

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
    for bad, match in (({"optimizer_class": torch.optim.LBFGS}, "LBFGS"),
                       ({"optimizer_class": torch.optim.SGD, "overlap_with_ddp": True}, "zero_stage=2")):
        with pytest.raises(ValueError, match=match):
            ddpkit.ZeroRedundancyOptimizer(models.make("mlp").parameters(), lr=0.1, **bad)
    return out


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
        for label in got:
            assert got[label]["print"] == results[0][label]["print"], f"{label}: rank {rank}'s replica differs"


class Reentrant(nn.Module):
    """A layer run twice inside a reentrant activation checkpoint (its gradient arrives in several parts), and
    the head's weight read by hand before the head runs (its bucket, the first ready, is gathered last)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(12, 16)
        self.twice = nn.Linear(16, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.twice(torch.tanh(self.twice(t)))), h,
                                              use_reentrant=True)
        h = h + 0.1 * torch.nn.functional.linear(torch.nn.functional.linear(h, self.head.weight), self.head.weight.t())
        return self.head(h)


def _waits_in_forward(model, x):
    """Which buckets the forward waited for, in order, and how many gathers were still in flight at each."""
    shards = model._grad_shards
    seen, wait = [], shards.wait

    def spy(index):
        if index in shards.gathers:
            seen.append((index, shards._reading, len(shards.gathers)))
        wait(index)

    shards.wait = spy
    try:
        model(x)
    finally:
        del shards.wait
    return seen, shards.bucket_of[id(model.module.inp.weight)]


def stage2_surface(world):
    """Stage 2: the next forward waits for the gathers by itself; reentrant checkpointing; the refusals."""
    import ddpkit

    losses, norms = {}, {}
    for stage in (0, 2):
        torch.manual_seed(0)
        module = Reentrant()
        model = ddpkit.DistributedDataParallel(module, bucket_cap_mb=0.0001, zero_stage=stage)  # the head alone
        opt = ddpkit.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2) if stage else \
            torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses[stage], norms[stage] = [], []
        for step in range(STEPS + 1):
            x, y = _micro("mlp", step, 0, world.world_size)[world.rank]
            opt.zero_grad()
            loss = _loss("mlp", model, x, y, world.rank, step)  # no wait_for_params: the forward waits
            losses[stage].append(loss.item())
            loss.backward()
            clip = opt.clip_grad_norm_ if stage else functools.partial(torch.nn.utils.clip_grad_norm_,
                                                                        model.parameters())
            norms[stage].append(float(clip(0.05)))
            opt.step()
        if stage:
            waits = _waits_in_forward(model, x)
        model.check_replicas()
    twice = _two_synced_backwards(world)
    torch.manual_seed(0)
    lonely = ddpkit.DistributedDataParallel(models.make("mlp"), zero_stage=2)
    x, y = _micro("mlp", 0, 0, world.world_size)[world.rank]
    with pytest.raises(RuntimeError, match="ZeroRedundancyOptimizer"):
        _loss("mlp", lonely, x, y, world.rank, 0).backward()
    with pytest.raises(RuntimeError, match="comm hook"):
        lonely.register_comm_hook(None, lambda state, bucket: None)
    with pytest.raises(ValueError, match="stage 1"):
        ddpkit.DistributedDataParallel(models.make("mlp"), zero_stage=1)
    with pytest.raises(ValueError, match="whole tensors"):
        ddpkit.ZeroRedundancyOptimizer(lonely.parameters(), torch.optim.Adafactor)
    return losses, norms, waits, twice


def _two_synced_backwards(world):
    """Two synchronised backward passes per step (no no_sync): stage 2 sums the two averaged shards, as DDP sums
    into .grad; SGD steps from one and the other, the largest difference of the parameters afterwards."""
    import ddpkit

    runs = []
    for stage in (0, 2):
        torch.manual_seed(0)
        model = ddpkit.DistributedDataParallel(models.make("mlp"), bucket_cap_mb=0.001, zero_stage=stage)
        opt = ddpkit.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1) if stage else \
            torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(STEPS):
            opt.zero_grad()
            for micro in range(2):
                x, y = _micro("mlp", step, micro, world.world_size)[world.rank]
                _loss("mlp", model, x, y, world.rank, step).backward()
            opt.step()
        if stage:
            opt.wait_for_params()  # read outside a forward: the last gathers must be waited for by hand
        runs.append(list(model.module.parameters()))
    return max((a - b).abs().max().item() for a, b in zip(*runs))


def test_stage2_forward_waits_reentrant_and_refusals():
    for rank, (losses, norms, (waits, first), twice) in enumerate(run_world(stage2_surface, 2, deadline_s=180)):
        # DDP adds the second average into .grad, stage 2 into the shard: the same sum, rounded otherwise.
        assert twice <= TOL, f"two synchronised backwards per step: {twice} from DDP"
        # The forward waits for the first layer's bucket first, while the others are still in flight, and
        # every wait happens inside it (the read of the head's weight by hand waited too: see the losses).
        assert waits and waits[0][0] == first and waits[0][2] > 1, waits
        assert all(reading for _, reading, _ in waits), waits
        # Clipped steps: the norm from the shards sums its squares in another order than torch's, so the
        # runs agree to rounding, not bit for bit. A forward that did not wait for the gathers would read
        # parameters a whole step old: off by ~lr (1e-2), not 1e-6.
        assert min(norms[0]) > 0.05, "the test must clip"
        assert all(abs(a - b) <= 1e-6 * a for a, b in zip(norms[0], norms[2])), (norms[0], norms[2])
        assert all(abs(a - b) <= 1e-6 for a, b in zip(losses[0], losses[2])), (rank, losses[0], losses[2])


GLOBAL = 6  # samples per step, split evenly over 1, 2 or 3 ranks
RESUME_STEPS, SAVE_AT = 5, 3


def resume_run(world, stage, folder, load):
    """Train RESUME_STEPS AdamW steps of one global batch each (stage 0: DDP + AdamW; 1: + ZeRO; 2: zero_stage=2),
    saving a checkpoint after SAVE_AT, or start from that checkpoint; the full-batch loss after each step."""
    import ddpkit
    from ddpkit.checkpoint import find_latest_checkpoint, load_checkpoint, save_checkpoint

    torch.manual_seed(0)
    module = models.make("transformer")
    model = ddpkit.DistributedDataParallel(module, bucket_cap_mb=0.002, zero_stage=2 if stage == 2 else 0)
    groups = [{"params": [p for p in module.parameters() if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for p in module.parameters() if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-3, eps=1e-4) if stage == 0 else \
        ddpkit.ZeroRedundancyOptimizer(groups, torch.optim.AdamW, lr=1e-3, eps=1e-4)
    start = 0
    if load:
        start = load_checkpoint(find_latest_checkpoint(folder), model=module, optimizer=opt, world=world).step
    share = GLOBAL // world.world_size
    curve = {}
    for step in range(start, RESUME_STEPS):
        x, y = models.batch("transformer", GLOBAL, seed=step)
        opt.zero_grad()
        lo = world.rank * share
        models.loss("transformer", model, x[lo:lo + share], y[lo:lo + share], world.rank, step).backward()
        opt.step()
        if stage:
            opt.wait_for_params()
        with torch.no_grad():
            probe_x, probe_y = models.batch("transformer", GLOBAL, seed=999)
            curve[step] = models.loss("transformer", module, probe_x, probe_y, 0, step).item()
        if not load and step + 1 == SAVE_AT:
            save_checkpoint(folder, step + 1, model=module, optimizer=opt, trainer_state={"global_step": step + 1},
                            comm=ddpkit.Comm.for_group(), world=world)
    files = sorted(os.listdir(find_latest_checkpoint(folder)))
    return curve, files


@pytest.mark.parametrize("saved, resumed", [((2, 2), (3, 1)), ((3, 1), (1, 0)), ((2, 2), (2, 0)),
                                            ((1, 0), (2, 2))])
def test_resume_across_stages_and_world_sizes(tmp_path, saved, resumed):
    (n_saved, stage_saved), (n_resumed, stage_resumed) = saved, resumed
    folder = str(tmp_path)
    whole, files = run_world(resume_run, n_saved, args=(stage_saved, folder, False), deadline_s=180)[0]
    if stage_saved:  # each rank wrote its slice; nobody wrote the whole state
        assert [f for f in files if f.startswith("optimizer")] == [f"optimizer_shard_{r}.pt" for r in range(n_saved)]
    results = run_world(resume_run, n_resumed, args=(stage_resumed, folder, True), deadline_s=180)
    for rank, (curve, _) in enumerate(results):
        assert sorted(curve) == list(range(SAVE_AT, RESUME_STEPS))
        for step, loss in curve.items():
            # Another world size sums the gradient average in another order: float32 rounding, relative 1e-6.
            assert abs(loss - whole[step]) <= 1e-6 * max(1.0, abs(whole[step])), \
                f"rank {rank} step {step}: {loss} resumed, {whole[step]} uninterrupted"


class Plain(nn.Module):
    """test_trainer's classifier without dropout, so that one rank and two draw the same computation."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x, labels=None, idx=None):
        logits = self.net(x)
        return {"loss": None if labels is None else torch.nn.functional.cross_entropy(logits, labels),
                "logits": logits}


def trainer_run(world, out, stage, resume, accumulation):
    """The Trainer with ddp_zero_stage=stage: 6 AdamW steps of a global batch of 8, clipped, saved every 2."""
    from ddpkit import Trainer
    from conftest import classification_data, trainer_args

    torch.manual_seed(0)
    model = Plain().double()
    args = trainer_args(out, per_device_train_batch_size=2, gradient_accumulation_steps=accumulation, max_steps=6,
                 save_strategy="steps", save_steps=2, max_grad_norm=0.1, ddp_zero_stage=stage,
                 ddp_replica_check_steps=1)
    trainer = Trainer(model, args, classification_data(32))
    trainer.train(resume_from_checkpoint=resume)
    return [(e["step"], e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e]


def test_trainer_stages_resume_across_stages_and_world_sizes(tmp_path):
    out = str(tmp_path)
    stage2 = run_world(trainer_run, 2, args=(f"{out}/z2", 2, None, 2), deadline_s=150)[0]
    stage0 = run_world(trainer_run, 2, args=(f"{out}/z0", 0, None, 2), deadline_s=150)[0]
    # Resumed from stage 2's sharded checkpoint at step 4: one rank, stage 0, the same global batch of 8.
    (one,) = run_world(trainer_run, 1, args=(f"{out}/one", 0, f"{out}/z2/checkpoint-4", 4), deadline_s=150)
    # And stage 1 on two ranks from stage 0's whole optimizer.pt at step 2.
    stage1 = run_world(trainer_run, 2, args=(f"{out}/z1", 1, f"{out}/z0/checkpoint-2", 2), deadline_s=150)[0]
    assert [s for s, _, _ in stage2] == list(range(1, 7))
    assert min(norm for _, _, norm in stage0) > 0.1, "the test must clip"
    for label, run, first in (("stage 0", stage0, 1), ("1 rank from stage 2", one, 5), ("stage 1", stage1, 3)):
        got = {step: (loss, norm) for step, loss, norm in run if step >= first}  # before: the saved history
        assert sorted(got) == list(range(first, 7)), label
        for step, loss, norm in stage2[first - 1:]:
            # float64; another world size or a sharded norm sums in another order: rounding only.
            assert abs(got[step][0] - loss) <= 1e-9 * abs(loss) and abs(got[step][1] - norm) <= 1e-9 * norm, \
                f"{label}, step {step}: {got[step]} against stage 2's uninterrupted {(loss, norm)}"
    files = os.listdir(f"{out}/z2/checkpoint-4")
    assert "optimizer.pt" not in files and {"optimizer_shard_0.pt", "optimizer_shard_1.pt"} <= set(files)


def join_under_stage_2(world):
    import ddpkit

    model = ddpkit.DistributedDataParallel(torch.nn.Linear(4, 4), zero_stage=2)
    with pytest.raises(NotImplementedError, match="zero_stage=2"):
        model.join()
    model.join(enable=False)  # disabled: nothing to refuse
    return True


def test_join_is_refused_under_stage_2_until_it_is_supported():
    assert run_world(join_under_stage_2, 2) == [True, True]


def test_bench_memory_figures_count_what_they_say():
    """bench --zero's peak: the high-water mark of live tensor bytes allocated inside the run; its gradient
    bytes: each storage once, however many .grad views it backs."""
    from ddpkit.bench_zero_memory import grad_bytes, peak_bytes

    mib = 1 << 20

    def step(held):
        scratch = torch.ones(2 * mib // 4)  # freed at the end of the step: counts only while it lives
        held.append(scratch[: mib // 4].clone())

    # build: 1 MiB; step 1: + 2 scratch + 1 kept (4), down to 2; step 2: + 2 + 1 = 5 MiB at the peak.
    peak = peak_bytes(lambda: [torch.zeros(mib // 4)], step, 2)
    assert 5 * mib <= peak <= 5 * mib + 4096, peak
    layer = nn.Linear(4, 4)
    flat = torch.zeros(20)
    layer.weight.grad, layer.bias.grad = flat[:16].view(4, 4), flat[16:]
    assert grad_bytes(layer) == 80
    layer.bias.grad = torch.zeros(4)
    assert grad_bytes(layer) == 96
