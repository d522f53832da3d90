"""ZeroRedundancyOptimizer.clip_grad_norm_ (ddpkit.zero.unit.clip_shards_) against torch's clip_grad_norm_ on the
unsharded gradients, under stage 1 and stage 2: every norm type torch's takes but 0, and a NaN gradient."""

from __future__ import annotations

import math

import numpy as np
import torch

# Imported once before the ranks fork (the optimizers' first step imports it: seconds of CPU on each rank).
import torch._dynamo  # noqa: E402,F401
from torch import nn

from helpers.world import run_world


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _clipped(world, stage, norm_type, poison=None, dtype=torch.float32, typed=False, head_only=False, grads=False):
    """The norm the clip returns and the parameters after the clipped SGD step; poison: (parameter index,
    element) made NaN in the averaged gradient, on every rank. typed: the norm as its dtype's name and value.
    grads: every .grad after the clip instead."""
    import ddpkit

    torch.manual_seed(0)
    module = Net().to(dtype)
    model = ddpkit.DistributedDataParallel(module, zero_stage=2 if stage == 2 else 0)
    # head_only: an optimizer over some of the model's parameters (the rest trained otherwise, or frozen by hand)
    params = list(module.b.parameters()) if head_only else list(model.parameters())
    opt = (torch.optim.SGD(params, lr=0.1) if stage == 0 else
           ddpkit.ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(world.rank)).to(dtype)
    loss = model(x).float().square().mean()
    if poison is not None:  # NaN in one averaged gradient element: every rank's contribution NaN there
        param = list(module.parameters())[poison[0]]
        param.register_hook(lambda g: g.index_put((torch.tensor(poison[1]),), torch.tensor(math.nan)))
    loss.backward()
    if stage == 0:
        norm = torch.nn.utils.clip_grad_norm_(params, 0.01, norm_type=norm_type)
    else:
        norm = opt.clip_grad_norm_(0.01, norm_type=norm_type)
    if grads:
        return [p.grad.detach().numpy().copy() for p in module.parameters()]  # numpy: tensors cannot travel back
    opt.step()
    if stage == 2:
        opt.wait_for_params()
    if typed:
        return str(norm.dtype), float(norm)
    return float(norm), [p.detach().clone() for p in module.parameters()]


def clip_world(world):
    out = {}
    for norm_type in (2.0, 0.5, math.inf, -math.inf):
        plain = _clipped(world, 0, norm_type)
        for stage in (1, 2):
            norm, params = _clipped(world, stage, norm_type)
            out[(norm_type, stage)] = (plain[0], norm, max((a - b).abs().max().item()
                                                           for a, b in zip(plain[1], params)))
    # The NaN on rank 1's side of every shard split (the last parameter) and on rank 0's (the first)
    for stage in (1, 2):
        out[("nan", stage)] = [_clipped(world, stage, math.inf, poison=(p, 0))[0] for p in (0, 3)]
    plain = _clipped(world, 0, 2.0, head_only=True)
    for stage in (1, 2):  # the norm of the optimizer's own gradients only (stage 2 read its buckets' others too)
        norm, params = _clipped(world, stage, 2.0, head_only=True)
        out[("head only", stage)] = (plain[0], norm, max((a - b).abs().max().item() for a, b in zip(plain[1], params)))
    for stage in (0, 1, 2):  # bf16 and fp16 gradients: the norm in their dtype, as torch's returns it
        out[("bf16", stage)] = _clipped(world, stage, 2.0, dtype=torch.bfloat16, typed=True)
        out[("fp16", stage)] = _clipped(world, stage, 2.0, dtype=torch.float16, typed=True)
    out["grads"] = (_clipped(world, 0, 2.0, grads=True), _clipped(world, 1, 2.0, grads=True))
    try:
        _clipped(world, 1, 0)
        out["zero"] = "no error"
    except ValueError as exc:
        out["zero"] = str(exc)
    return out


def test_clip_grad_norm_over_shards_matches_torch_for_every_norm_and_a_nan():
    results = run_world(clip_world, 2, deadline_s=120)
    # Stage 1 scales every .grad (each rank holds them all, averaged), alike on every rank, as torch's clip does;
    # it scaled only the rank's own slices, leaving .grad different on each rank and from stage 0's.
    assert all((a == b).all() for a, b in zip(results[0]["grads"][1], results[1]["grads"][1]))
    assert all(np.allclose(a, b, rtol=1e-6, atol=0) for a, b in zip(*results[0]["grads"]))
    for got in results:
        for key, value in got.items():
            if isinstance(key, tuple) and key[0] not in ("nan", "bf16", "fp16"):
                torch_norm, sharded_norm, param_error = value
                assert math.isclose(torch_norm, sharded_norm, rel_tol=1e-6), (key, value)  # the sum's order
                assert param_error <= 1e-7, (key, value)
        # gloo's MAX all-reduce drops a NaN held by a later rank (max(5, nan) is 5): the norm must be NaN anyway
        assert all(math.isnan(n) for stage in (1, 2) for n in got[("nan", stage)]), got
        assert got[(-math.inf, 1)][0] < got[(math.inf, 1)][0]  # the smallest |element|, not the largest
        assert "norm_type other than 0" in got["zero"], got["zero"]
        # The pieces' norms are taken in float32 (torch rounds each whole tensor's to bf16, then takes the norm of
        # those): the same dtype as torch's, and the same value to within one bf16 step (2**-7 relative), which
        # is where the two roundings may part on some host (stages 1 and 2 cut the pieces differently, too).
        assert all(math.isclose(got[("bf16", stage)][1], got[("bf16", 0)][1], rel_tol=2 ** -7) for stage in (1, 2)), got
        assert got[("bf16", 0)][0] == "torch.bfloat16"
        assert got[("fp16", 1)][0] == got[("fp16", 2)][0] == got[("fp16", 0)][0] == "torch.float16", got


def test_state_dict_after_add_param_group_covers_the_new_group():
    """A consolidated state gathered before add_param_group is not handed out after it (it had one group less,
    and its own load_state_dict refused it)."""
    import ddpkit

    a, b = nn.Linear(3, 3), nn.Linear(3, 1)
    opt = ddpkit.ZeroRedundancyOptimizer(a.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    assert (opt.global_rank, opt.initialized, opt._overlap_with_ddp) == (0, True, False)  # torch's attributes
    b(a(torch.ones(2, 3))).sum().backward()
    opt.step()
    opt.consolidate_state_dict()
    assert len(opt.state_dict()["param_groups"]) == 1
    opt.add_param_group({"params": list(b.parameters()), "lr": 0.05})
    state = opt.state_dict()
    assert [g["lr"] for g in state["param_groups"]] == [0.1, 0.05], state["param_groups"]
    opt.load_state_dict(state)
