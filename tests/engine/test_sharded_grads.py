"""DistributedDataParallel(zero_stage=2) (ddpkit.engine.sharded_grads): the forward waits only for the buckets it reads,
reentrant checkpointing, refusals, two synchronised backwards per step, and join() refused for now."""

from __future__ import annotations

import functools
import sys

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.join import Join as TorchJoin

from helpers import models
from helpers.models import save_and_load
from helpers.world import run_world

SHARD = 3  # samples per rank per micro-batch
STEPS = 3
TOL = 1e-6


def _micro(name, step, micro, world_size):
    return models.micro(name, step, micro, world_size, SHARD)


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
            seen.append((index, len(shards.gathers)))
        wait(index)

    shards.wait = spy
    try:
        model(x)
    finally:
        del shards.wait
    weight = model.module.inp.weight
    return seen, next(i for i, bucket in shards.buckets.items() if any(p is weight for p in bucket.params))


def stage2_surface(world):
    """Stage 2: the next forward waits for the gathers by itself; reentrant checkpointing; the refusals."""
    import ddpkit

    # A graph compiled in this process (the parent's, forked) makes every forward wait for all gathers first
    # (zero_grads._compiled): this world compiles nothing, so the forward's own waits are what it checks.
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is not None:
        utils.counters.clear()

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
            loss = models.loss("mlp", model, x, y, world.rank, step)  # no wait_for_params: the forward waits
            losses[stage].append(loss.item())
            loss.backward()
            clip = opt.clip_grad_norm_ if stage else functools.partial(torch.nn.utils.clip_grad_norm_,
                                                                        model.parameters())
            norms[stage].append(float(clip(0.05)))
            opt.step()
        if stage:
            waits = _waits_in_forward(model, x)
            # A load_state_dict with gathers in flight waits for them first: they land straight in the
            # parameters, and a late one would overwrite the loaded weights.
            saved = {k: v.clone() for k, v in module.state_dict().items()}
            models.loss("mlp", model, x, y, world.rank, 0).backward()
            opt.step()
            in_flight = len(model._grad_shards.gathers)
            module.load_state_dict(saved)
            loaded = (in_flight, len(model._grad_shards.gathers),
                      all(torch.equal(p, saved[k]) for k, p in module.named_parameters()))
        model.check_replicas()
    twice = _two_synced_backwards(world)
    torch.manual_seed(0)
    lonely = ddpkit.DistributedDataParallel(models.make("mlp"), zero_stage=2)
    x, y = _micro("mlp", 0, 0, world.world_size)[world.rank]
    with pytest.raises(RuntimeError, match="ZeroRedundancyOptimizer"):
        models.loss("mlp", lonely, x, y, world.rank, 0).backward()
    with pytest.raises(RuntimeError, match="comm hook"):
        lonely.register_comm_hook(None, lambda state, bucket: None)
    with pytest.raises(ValueError, match="stage 1"):
        ddpkit.DistributedDataParallel(models.make("mlp"), zero_stage=1)
    with pytest.raises(ValueError, match="whole tensors"):
        ddpkit.ZeroRedundancyOptimizer(lonely.parameters(), torch.optim.Adafactor)
    return losses, norms, waits, twice, loaded


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
                models.loss("mlp", model, x, y, world.rank, step).backward()
            opt.step()
        if stage:
            opt.wait_for_params()  # read outside a forward: the last gathers must be waited for by hand
        runs.append(list(model.module.parameters()))
    return max((a - b).abs().max().item() for a, b in zip(*runs))


def test_stage2_forward_waits_reentrant_and_refusals():
    for rank, (losses, norms, (waits, first), twice, loaded) in enumerate(run_world(stage2_surface, 2,
                                                                                  deadline_s=180)):
        assert loaded[0] > 0 and loaded[1:] == (0, True), f"load_state_dict with gathers in flight: {loaded}"
        # DDP adds the second average into .grad, stage 2 into the shard: the same sum, rounded otherwise.
        assert twice <= TOL, f"two synchronised backwards per step: {twice} from DDP"
        # The forward waits for the first layer's bucket first, while the others are still in flight (the read
        # of the head's weight by hand waited too: see the losses).
        assert waits and waits[0][0] == first and waits[0][1] > 1, waits
        # Clipped steps: the norm from the shards sums its squares in another order than torch's, so the
        # runs agree to rounding, not bit for bit. A forward that did not wait for the gathers would read
        # parameters a whole step old: off by ~lr (1e-2), not 1e-6.
        assert min(norms[0]) > 0.05, "the test must clip"
        assert all(abs(a - b) <= 1e-6 * a for a, b in zip(norms[0], norms[2])), (norms[0], norms[2])
        assert all(abs(a - b) <= 1e-6 for a, b in zip(losses[0], losses[2])), (rank, losses[0], losses[2])


def join_under_stage_2(world):
    import ddpkit

    model = ddpkit.DistributedDataParallel(torch.nn.Linear(4, 4), zero_stage=2)
    with pytest.raises(NotImplementedError, match="zero_stage=2"):
        model.join()
    model.join(enable=False)  # disabled: nothing to refuse
    zero = ddpkit.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    for joinables in ([model], [zero], [model, zero]):  # torch's Join asks each for its hook, even disabled
        for enable in (True, False):
            with pytest.raises(NotImplementedError, match="zero_stage=2"):
                TorchJoin(joinables, enable=enable)  # on every rank, before any collective
    model(torch.ones(2, 4)).sum().backward()  # and both still train outside any Join
    zero.step()
    with pytest.raises(NotImplementedError, match="add_param_group under zero_stage=2"):
        zero.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    assert len(zero.param_groups) == 1  # refused before anything changed, as torch's
    return True


def test_join_is_refused_under_stage_2_until_it_is_supported():
    assert run_world(join_under_stage_2, 2) == [True, True]


def _train_as_users_do(world, stage):
    """STEPS + 1 SGD steps, clearing on the wrapper, with the parameters' memory replaced after step 1; the model,
    its optimizer and whether every step bumped every parameter's autograd version."""
    import ddpkit

    torch.manual_seed(0)
    model = ddpkit.DistributedDataParallel(models.make("mlp"), bucket_cap_mb=0.001, zero_stage=2 if stage == 2 else 0)
    opt = ddpkit.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1) if stage else \
        torch.optim.SGD(model.parameters(), lr=0.1)
    bumped = True
    for step in range(STEPS + 1):
        x, y = _micro("mlp", step, 0, world.world_size)[world.rank]
        models.loss("mlp", model, x, y, world.rank, step).backward()
        before = [p._version for p in model.parameters()]
        opt.step()
        # autograd must see every parameter change on every rank, as after an unsharded step
        bumped = bumped and all(p._version > v for p, v in zip(model.parameters(), before))
        model.zero_grad()  # the wrapper's: under stage 2 it must clear the shards too
        if step == 1:
            with torch.no_grad():  # new memory for every parameter, the same values
                vector = torch.nn.utils.parameters_to_vector(model.parameters()).clone()
                torch.nn.utils.vector_to_parameters(vector, model.parameters())
    return model, opt, bumped


def _saves(model):
    """The module, a deepcopy, its first parameter, the pickled wrapper and a keep_vars state_dict, saved and
    loaded back (under stage 2 with the last step's gathers still in flight: saving must see the new values)."""
    import copy
    import pickle

    return [save_and_load(model.module).state_dict(), save_and_load(copy.deepcopy(model.module)).state_dict(),
            save_and_load(next(model.module.parameters()), weights_only=True),
            pickle.loads(pickle.dumps(model)).module.state_dict(),
            save_and_load(model.module.state_dict(keep_vars=True), weights_only=True)]


def _hooks_and_warnings(world, model, opt):
    """Stage 2: the module's hook counts after two pickle round trips (the live wrapper's alone), and how many
    warnings a backward gives after clearing only the inner module's gradients."""
    import pickle
    import warnings

    twice = pickle.loads(pickle.dumps(pickle.loads(pickle.dumps(model))))
    hooks = [len(h) for h in (twice.module._forward_pre_hooks, twice.module._state_dict_pre_hooks,
                              twice.module._load_state_dict_pre_hooks)]
    x, y = _micro("mlp", 0, 0, world.world_size)[world.rank]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        models.loss("mlp", model, x, y, world.rank, 0).backward()
        opt.step()
        model.module.zero_grad()  # cannot reach the shards the step used: the next backward says so
        models.loss("mlp", model, x, y, world.rank, 0).backward()
    return hooks, [w.filename for w in caught if "optimizer.zero_grad()" in str(w.message)]  # this file's line


def _refuses_a_tie_through_data(model, opt):
    """Tied through .data after the optimizer was built: the two gathers would collide."""
    weight, bias = list(model.module.parameters())[:2]
    with torch.no_grad():
        bias.data = weight.data.view(-1)[:bias.numel()].view_as(bias)
    with pytest.raises(ValueError, match="shares its memory"):
        opt.step()
    return True


def user_paths(world):
    """What user code does around a sharded model, against plain DDP from the same seed and data: clearing the
    gradients on the wrapper (model.zero_grad()), replacing the parameters' memory after a step
    (vector_to_parameters: ZeroRedundancyOptimizer must step the new memory), saving the module, a parameter
    and the wrapper whole with gathers in flight, and the warning when only the inner module is cleared."""
    params, saved, bumped, refused = {}, {}, {}, {}
    for stage in (0, 1, 2):
        model, opt, bumped[stage] = _train_as_users_do(world, stage)
        saved[stage] = _saves(model)
        params[stage] = [p.detach().clone() for p in model.module.parameters()]
        model.check_replicas()
        if stage == 2:
            hooks, warned = _hooks_and_warnings(world, model, opt)
        if stage:
            refused[stage] = _refuses_a_tie_through_data(model, opt)
    # SGD steps each shard element as DDP steps it; the shards' sums are rank-ordered, DDP's ring's not
    diffs = {stage: max((a - b).abs().max().item() for a, b in zip(params[stage], params[0])) for stage in (1, 2)}
    keys = list(saved[0][0])
    reloaded, first = {}, {}
    for stage in (1, 2):
        module, copied, one, unpickled, kept = saved[stage]
        for name, got in (("module", module), ("deepcopy", copied), ("wrapper", unpickled), ("keep_vars", kept)):
            reloaded[stage, name] = list(got) == keys and all(torch.equal(v, p)
                                                              for v, p in zip(got.values(), params[stage]))
        first[stage] = torch.equal(one, params[stage][0]) and type(one) is nn.Parameter
    return diffs, reloaded, first, warned, bumped, refused, hooks


def test_user_paths_around_a_sharded_model():
    for rank, (diffs, reloaded, first, warned, bumped, refused, hooks) in enumerate(run_world(user_paths, 2,
                                                                                               deadline_s=180)):
        assert hooks == [1, 1, 1], f"rank {rank}: the module's hooks after two pickle round trips: {hooks}"
        assert bumped == {0: True, 1: True, 2: True}, f"rank {rank}: every step bumped every version: {bumped}"
        assert refused == {1: True, 2: True}, refused
        assert all(d <= TOL for d in diffs.values()), f"rank {rank}: stage -> largest difference from DDP {diffs}"
        assert all(reloaded.values()), f"rank {rank}: saved and loaded equal to the parameters: {reloaded}"
        assert all(first.values()), f"rank {rank}: torch.save of one parameter: {first}"
        assert warned == [__file__], f"rank {rank}: warnings when only the inner module was cleared: {warned}"


class Branch(nn.Module):
    """A side layer used only at the first step, on every rank."""

    def __init__(self):
        super().__init__()
        self.trunk, self.side, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x, side):
        h = torch.tanh(self.trunk(x))
        return self.head(h + torch.tanh(self.side(h)) if side else h)


def _stage2_against_plain(world, prepare, steps, set_to_none=True):
    """Train a stage-2 model and the plain DDP one side by side: the largest parameter difference after each
    step. prepare(optimizer, index): called once after construction (index 0 plain, 1 stage 2)."""
    import ddpkit

    runs = []
    for stage in (0, 2):
        torch.manual_seed(0)
        module = Branch()
        model = ddpkit.DistributedDataParallel(module, zero_stage=stage)
        opt = (torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1) if stage == 0 else
               ddpkit.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1))
        prepare(opt, len(runs))
        runs.append((module, model, opt))
    errors = []
    for step in steps:
        for module, model, opt in runs:
            opt.zero_grad(set_to_none=set_to_none)
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + world.rank))
            model(x, side=step == 0).square().mean().backward()
            opt.step()
        errors.append(max((a - b).abs().max().item() for a, b in zip(*(r[0].parameters() for r in runs))))
    return errors, [r[2].param_groups[0]["lr"] for r in runs]


def _strays_against_plain(world):
    """Parameters of the optimizer in no bucket of the stage-2 wrapper: one outside the model (a temperature, as
    CLIP's) and one the wrapper is told to ignore. Their gradients are the same on every rank here, so that the
    plain optimizer keeps them equal too: the largest difference from plain DDP's parameters after each step."""
    import ddpkit

    runs = []
    for stage in (0, 2):
        torch.manual_seed(0)
        module = Branch()
        module.ignored = nn.Parameter(torch.ones(3))
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, ["ignored"])
        temp = nn.Parameter(torch.full((2,), 2.0))
        model = ddpkit.DistributedDataParallel(module, zero_stage=stage)
        params = list(model.parameters()) + [temp]
        opt = (torch.optim.AdamW(params, lr=1e-2) if stage == 0 else
               ddpkit.ZeroRedundancyOptimizer(params, torch.optim.AdamW, lr=1e-2))
        runs.append((params, model, opt, temp))
    errors = []
    for step in range(3):
        for params, model, opt, temp in runs:
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + world.rank))
            loss = model(x, side=step == 0).square().mean() + 3 * temp.sum() + model.module.ignored.square().sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
        errors.append(max((a - b).abs().max().item() for a, b in zip(runs[0][0], runs[1][0])))
    _, model, _, temp = runs[1]
    moved = [(p.detach() != start).all().item() for p, start in ((temp, 2.0), (model.module.ignored, 1.0))]
    return errors, moved


def optimizer_surface_under_stage_2(world):
    import copy

    out = {"kept zeros": _stage2_against_plain(world, lambda opt, i: None, range(3), set_to_none=False)[0]}
    out["strays"] = _strays_against_plain(world)
    # A state loaded before stage 2's first step (deferred until its shards are known) puts its hyperparameters
    # in param_groups at once, and a learning rate set after the load stays.
    saved = {}

    def first(opt, index):
        if index == 0:
            saved.update(copy.deepcopy(opt.state_dict()))

    _stage2_against_plain(world, first, range(1))  # an AdamW state (lr 1e-2) after one step

    def load_then_lower(opt, index):
        opt.load_state_dict(copy.deepcopy(saved))
        assert opt.param_groups[0]["lr"] == 1e-2
        opt.param_groups[0]["lr"] = 1e-4

    out["loaded"] = _stage2_against_plain(world, load_then_lower, range(1, 3))
    return out


def test_stage_2_keeps_zeroed_shards_steps_strays_and_loads_hyperparameters_at_once():
    for got in run_world(optimizer_surface_under_stage_2, 2, deadline_s=120):
        # zero_grad(set_to_none=False): the side layer, unused after step 0, is still stepped (weight decay,
        # momentum) with a zero gradient, as the unsharded AdamW steps every parameter whose .grad is set
        assert got["kept zeros"] == [0.0, 0.0, 0.0], got
        # A parameter outside the wrapper and one it ignores are stepped too (they were left as they were)
        assert got["strays"] == ([0.0, 0.0, 0.0], [True, True]), got
        errors, lrs = got["loaded"]
        assert errors == [0.0, 0.0] and lrs == [1e-4, 1e-4], got
