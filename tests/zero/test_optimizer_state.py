"""The ZeRO state path at its edges, against the unsharded optimizer: consolidate_state_dict + state_dict,
load_state_dict both ways, the sharded checkpoint (ddpkit.checkpoint.sharded) resumed on the same and another world
size and stage, and clip_grad_norm_ over the shards.

The edges, all in one model (`Edges`): parameters of 0 elements, which the unsharded optimizer keeps state for
once they have a gradient (AdamW's step count and empty moments, SGD's empty momentum); a parameter whose
gradient comes from the second step on (its `step` one behind the others'); one that never gets a gradient (no
entry at all); a float64 gain beside float32 layers; and a param group of no parameters. Every state entry must
be the unsharded optimizer's: the same keys, `step` values, dtypes, shapes and bits.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

# Imported once before the ranks fork (the optimizers' first step imports it: seconds of CPU on each rank).
import torch._dynamo  # noqa: E402,F401
from torch import nn

from helpers.world import run_world

OPTIMIZERS = {"AdamW": {"lr": 1e-2, "weight_decay": 0.1}, "SGD": {"lr": 1e-2, "momentum": 0.9}}
# (wrapper, ZeRO stage): the ZeroRedundancyOptimizer's setting, the unsharded one runs under the same wrapper
CONFIGS = {"stage 1": ("ddpkit", 1), "stage 1, torch's DDP, bucket view": ("torch", 1), "stage 2": ("ddpkit", 2)}
SAVED_AT = 2


class Edges(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.late, self.never = nn.Linear(4, 3), nn.Linear(4, 3), nn.Linear(4, 3)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 3, dtype=torch.float64))
        self.none, self.rows = nn.Parameter(torch.empty(0)), nn.Parameter(torch.empty(0, 4))

    def forward(self, x, step):
        h = self.lin(x) + self.none.sum() + (self.rows @ x.t()).sum()  # 0 + 0: gradients of 0 elements
        if step >= 1:
            h = h + self.late(x)
        return h * self.gain.float()


def _groups(m):
    # `rows` ends its group's elements (the last rank holds its piece), `none` begins its group's (rank 0)
    return [{"params": [m.lin.weight, m.late.weight, m.never.weight, m.rows], "weight_decay": 0.1},
            {"params": [], "lr": 0.5},
            {"params": [m.none, m.lin.bias, m.late.bias, m.never.bias, m.gain], "weight_decay": 0.0}]


def _build(config, cls, sharded):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import ddpkit

    wrapper, stage = config
    torch.manual_seed(0)
    module = Edges()
    model = TorchDDP(module, find_unused_parameters=True) if wrapper == "torch" else \
        ddpkit.DistributedDataParallel(module, bucket_cap_mb=0.0001, zero_stage=2 if sharded and stage == 2 else 0)
    make = getattr(torch.optim, cls)
    opt = ddpkit.ZeroRedundancyOptimizer(_groups(module), make, parameters_as_bucket_view=wrapper == "torch",
                                         **OPTIMIZERS[cls]) if sharded else make(_groups(module), **OPTIMIZERS[cls])
    return module, model, opt


def _step(run, step, rank):
    """One clipped step (the inf-norm, which torch's kernel refuses on a gradient of 0 elements; max_norm so
    large that nothing is scaled); the norm."""
    module, model, opt = run
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * step + rank))
    model(x, step).square().mean().backward()
    if hasattr(opt, "clip_grad_norm_"):
        norm = opt.clip_grad_norm_(1e9, math.inf)
    else:
        norm = torch.nn.utils.clip_grad_norm_([p for p in module.parameters() if p.numel()], 1e9, math.inf)
    opt.step()
    opt.zero_grad()
    if hasattr(opt, "wait_for_params"):
        opt.wait_for_params()
    return float(norm)


def _differences(got, want):
    """How state dict `got` differs from `want` (empty: not at all): param groups, entries, keys, values."""
    out = [] if got["param_groups"] == want["param_groups"] else [f"param_groups {got['param_groups']}"]
    if got["state"].keys() != want["state"].keys():
        return out + [f"entries {sorted(got['state'])}, want {sorted(want['state'])}"]
    for index, state in want["state"].items():
        mine = got["state"][index]
        if mine.keys() != state.keys():
            out.append(f"{index}: keys {sorted(mine)}, want {sorted(state)}")
            continue
        for key, value in state.items():
            have = mine[key]
            if not isinstance(value, torch.Tensor):
                same = have == value
            else:
                same = isinstance(have, torch.Tensor) and (have.dtype, have.shape) == (value.dtype, value.shape) \
                    and torch.equal(have, value)
            if not same:
                out.append(f"{index}.{key}: {have!r}, want {value!r}")
    return out


def _whole(opt, world):
    """Every rank's view of the whole state: consolidated to rank 0 under ZeRO (None elsewhere), or its own."""
    if not hasattr(opt, "consolidate_state_dict"):
        return opt.state_dict()
    opt.consolidate_state_dict(to=0)
    return opt.state_dict() if world.rank == 0 else None


def _params_differ(a, b):
    return [i for i, (p, q) in enumerate(zip(a.parameters(), b.parameters())) if not torch.equal(p, q)]


def continue_from(world, folder, config, cls):
    """From the saved unsharded state (plain.pt) and the sharded checkpoint: the unsharded optimizer, ZeRO
    loading the unsharded state dict, ZeRO and the unsharded optimizer loading the checkpoint; how each differs
    from the unsharded state after loading and after one more step."""
    from ddpkit.checkpoint.files import load_checkpoint

    runs = {name: _build(config, cls, sharded) for name, sharded in (
        ("plain", False), ("loaded", True), ("resumed", True), ("checkpoint into plain", False))}
    for name, (module, _, opt) in runs.items():
        # A copy each: torch's load_state_dict keeps the very tensors it is given, and steps them in place
        saved = torch.load(os.path.join(folder, "plain.pt"), weights_only=True)
        if name != "resumed":
            module.load_state_dict(saved["module"])
        if name in ("plain", "loaded"):
            opt.load_state_dict(saved["optimizer"])
        else:  # "resumed" takes its weights from the checkpoint too: into the flat buffer's views under bucket_view
            load_checkpoint(os.path.join(folder, f"checkpoint-{SAVED_AT}"), optimizer=opt, world=world,
                            model=module if name == "resumed" else None)
    out = {}
    for when in ("loaded", "stepped"):
        want = runs["plain"][2].state_dict()
        for name, run in runs.items():
            got = _whole(run[2], world)
            if name != "plain" and got is not None:
                out[f"{name}, {when}"] = _differences(got, want) + _params_differ(run[0], runs["plain"][0])
        if when == "loaded":
            out["norms"] = [_step(run, SAVED_AT, world.rank) for run in runs.values()]
    return out


def continue_from_each(world, folder, name):
    """continue_from under config `name`, for the checkpoint of each optimizer class in `folder`."""
    return {cls: continue_from(world, os.path.join(folder, cls), CONFIGS[name], cls) for cls in OPTIMIZERS}


def save_and_compare(world, folder, config, resumed):
    """SAVED_AT steps of the unsharded optimizer and of ZeRO, side by side: how ZeRO's consolidated state
    differs, and the unsharded optimizer loading it; the checkpoint and the unsharded state saved, then
    continued from under every config in `resumed`."""
    import ddpkit
    from ddpkit.checkpoint.files import save_checkpoint

    out = {}
    for cls in OPTIMIZERS:
        where = os.path.join(folder, cls)
        plain, zero = _build(config, cls, False), _build(config, cls, True)
        norms = [(_step(plain, step, world.rank), _step(zero, step, world.rank)) for step in range(SAVED_AT)]
        got = {"norms": norms, "params": _params_differ(plain[0], zero[0])}
        mine = _whole(zero[2], world)
        if world.rank == 0:
            got["consolidated"] = _differences(mine, plain[2].state_dict())
            back = getattr(torch.optim, cls)(_groups(Edges()), **OPTIMIZERS[cls])  # unwrapped: rank 0 alone
            back.load_state_dict(mine)
            got["ours into plain"] = _differences(back.state_dict(), plain[2].state_dict())
            os.makedirs(where, exist_ok=True)
            torch.save({"module": plain[0].state_dict(), "optimizer": plain[2].state_dict()},
                       os.path.join(where, "plain.pt"))
        # ZeRO's weights (the unsharded run's, see "params"); with parameters_as_bucket_view each is a view of one
        # flat buffer, which safetensors' own save_model refuses to write (ddpkit.checkpoint.model_weights writes each view's values)
        save_checkpoint(where, SAVED_AT, model=zero[0], optimizer=zero[2], trainer_state={"global_step": SAVED_AT},
                        comm=ddpkit.Comm.for_group(), world=world)
        got["files"] = sorted(f for f in os.listdir(os.path.join(where, f"checkpoint-{SAVED_AT}"))
                              if f.startswith("optimizer"))
        for name in resumed:
            got[name] = continue_from(world, where, CONFIGS[name], cls)
        out[cls] = got
    return out


def _assert_continued(got, what):
    norms = got.pop("norms")
    assert norms[1:] == norms[:1] * 3, f"{what}: inf-norms of the runs {norms}"
    for name, differences in got.items():
        assert differences == [], f"{what}, {name}: {differences}"


# Each saved run resumes under every config on its own world size, and on 3 ranks under another config of stage
# 1 (stage 2 on 3 ranks sums the gradients in another order than DDP: not bitwise the unsharded run's).
ELSEWHERE = {"stage 1": "stage 1, torch's DDP, bucket view", "stage 1, torch's DDP, bucket view": "stage 1",
             "stage 2": "stage 1"}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_state_of_zero_element_late_and_unused_parameters_matches_the_unsharded_optimizers(tmp_path, config):
    folder = str(tmp_path)
    results = run_world(save_and_compare, 2, args=(folder, CONFIGS[config], sorted(CONFIGS)), deadline_s=180)
    for rank, result in enumerate(results):
        for cls, got in result.items():
            what = f"{config}, {cls}, rank {rank}"
            assert all(a == b for a, b in got["norms"]), f"{what}: inf-norms (unsharded, ZeRO) {got['norms']}"
            assert got["params"] == [], f"{what}: parameters {got['params']} differ from the unsharded run's"
            assert got["files"] == ["optimizer_shard_0.pt", "optimizer_shard_1.pt"], f"{what}: {got['files']}"
            if rank == 0:
                assert got["consolidated"] == [], f"{what}: consolidated state: {got['consolidated']}"
                assert got["ours into plain"] == [], f"{what}: loaded into {cls}: {got['ours into plain']}"
            for name in CONFIGS:
                _assert_continued(got[name], f"{what}, continued under {name}")
    for rank, result in enumerate(run_world(continue_from_each, 3, args=(folder, ELSEWHERE[config]),
                                            deadline_s=180)):
        for cls, got in result.items():
            _assert_continued(got, f"{config} on 2 ranks, {cls}, continued under {ELSEWHERE[config]} on 3, rank {rank}")


def test_a_parameter_in_two_groups_is_refused_as_torch_refuses_it():
    import ddpkit

    shared, other = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))
    groups = [{"params": [shared]}, {"params": [other, shared]}]
    with pytest.raises(ValueError, match="more than one parameter group"):
        torch.optim.AdamW(groups)
    with pytest.raises(ValueError, match="more than one parameter group"):
        ddpkit.ZeroRedundancyOptimizer(groups, torch.optim.AdamW)
    opt = ddpkit.ZeroRedundancyOptimizer([shared], torch.optim.AdamW)
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [other, shared]})
    assert len(opt.param_groups) == 1 and len(opt.optim.param_groups) == 1, "refused before anything changed"


def test_whole_parameters_give_a_zero_element_parameter_state_too():
    """A factory is not known to step elementwise: whole parameters (zero_partition.partition_whole), in a world
    of one here. The parameter of 0 elements is stepped and in the state, as under the unsharded AdamW."""
    import ddpkit

    def build(sharded):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(3, 2)), nn.Parameter(torch.empty(0, 4))]
        opt = ddpkit.ZeroRedundancyOptimizer(params, lambda ps, **kw: torch.optim.AdamW(ps, **kw), lr=0.1) \
            if sharded else torch.optim.AdamW(params, lr=0.1)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        return opt

    zero, plain = build(True), build(False)
    assert zero.whole
    assert _differences(zero.state_dict(), plain.state_dict()) == []
