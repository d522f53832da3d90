"""torch's DistributedDataParallel surface on ddpkit's wrapper: every method is ours, refused, or safe to inherit.

The walk covers everything torch's class defines beyond nn.Module, so a method a new torch adds fails here,
by name, until it is implemented or refused (ddpkit.engine.torch_surface.REFUSED) or shown to need none of torch's
fields (ddpkit.engine.torch_surface.INHERITED).
"""

from __future__ import annotations

import contextlib
import copy
import dis
import inspect
import os

import pytest
import torch
import torch.distributed.algorithms.join
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from helpers import models
from helpers.models import assert_close_grads, fingerprint, grads_of
from helpers.world import run_world

SHARD = 4  # samples per rank, as in test_ddp.py
TOL = 1e-5
ABC_INTERNALS = {"__abstractmethods__", "_abc_impl"}


def torch_surface() -> list[str]:
    return [name for name in TorchDDP.__dict__ if name not in nn.Module.__dict__ and name not in ABC_INTERNALS]


def _ours(name: str):
    """ddpkit's own definition of `name` (from a class before torch's in the MRO), or None."""
    import ddpkit

    for cls in ddpkit.DistributedDataParallel.__mro__:
        if cls is TorchDDP:
            return None
        if name in cls.__dict__:
            return cls.__dict__[name]
    return None


def _self_attributes(function) -> set[str]:
    """The attributes `function` reads from its first argument (self)."""
    code = getattr(function, "__func__", function).__code__
    first = code.co_varnames[0] if code.co_argcount else None
    names, previous = set(), None
    for instruction in dis.get_instructions(code):
        if previous is not None and previous.opname == "LOAD_FAST" and previous.argval == first \
                and instruction.opname in ("LOAD_ATTR", "LOAD_METHOD"):
            names.add(instruction.argval)
        previous = instruction
    return names


def test_every_torch_method_is_implemented_refused_or_safely_inherited():
    from ddpkit.engine import torch_surface as ddp_surface

    names = torch_surface()
    assert len(names) > 40, names  # the walk sees torch's class, not an empty list
    missing = [n for n in names if n not in ddp_surface.INHERITED and _ours(n) is None]
    assert not missing, f"torch's DistributedDataParallel has {missing}, which ddpkit neither implements nor " \
                        "refuses: implement it, add it to ddp_surface.REFUSED, or (if it reads none of torch's " \
                        "fields) to ddp_surface.INHERITED"
    stale = sorted((set(ddp_surface.REFUSED) | ddp_surface.INHERITED) - set(names))
    assert not stale, f"no longer in torch's class: {stale}"
    # torch's overrides of nn.Module methods: the engine-bound ones are ours, train is torch's (it returns self).
    for name in ("__init__", "forward", "__getstate__", "__setstate__"):
        assert _ours(name) is not None, name


def test_inherited_methods_read_only_fields_ddpkit_has():
    import ddpkit
    from ddpkit.engine import torch_surface as ddp_surface

    ddp = ddpkit.DistributedDataParallel(models.MLP())
    for name in sorted(ddp_surface.INHERITED):
        member = inspect.getattr_static(TorchDDP, name)
        function = getattr(member, "__func__", member)
        if not callable(function):
            continue  # a class attribute (Dynamo's _active_ddp_module)
        if isinstance(member, staticmethod):
            assert "self" not in inspect.signature(function).parameters, name
            continue
        read = _self_attributes(function)
        lacking = sorted(attr for attr in read if not hasattr(ddp, attr))
        assert not lacking, f"torch's {name} reads {lacking}, which ddpkit's wrapper does not have"
    assert ddp.train(False) is ddp and not ddp.module.training
    assert len(list(ddp._get_parameters(ddp.module))) == len(list(ddp.module.parameters()))


def test_refused_methods_name_ddpkit():
    import ddpkit
    from ddpkit.engine import torch_surface as ddp_surface

    ddp = ddpkit.DistributedDataParallel(models.MLP())
    for name in ddp_surface.REFUSED:
        assert getattr(_ours(name), "ddpkit_refused", False), f"{name} is in REFUSED but implemented"
        with pytest.raises(NotImplementedError, match=rf"{name} is torch's, and ddpkit's wrapper"):
            getattr(ddp, name)()
    # torch's join internals name what replaces them.
    with pytest.raises(NotImplementedError, match=r"ddpkit's join hook.*model\.join\(\)"):
        ddp._sync_final_model(True)


def test_implemented_methods_in_a_world_of_one():
    import ddpkit

    ddp = ddpkit.DistributedDataParallel(models.ConvBN())
    assert ddp.join_device == torch.device("cpu")
    assert ddp.join_process_group is None and ddp._distributed_rank == 0
    hook = ddp.join_hook(divide_by_initial_world_size=False)
    assert isinstance(hook, torch.distributed.algorithms.join.JoinHook)
    assert ddp._join_divide_by_initial_world_size is False
    with ddp.join():  # a world of one: nobody to wait for, nothing changes
        ddp(torch.randn(2, 1, 8, 8)).sum().backward()
    assert ddp.will_sync_module_buffers() is False  # nothing to broadcast to
    assert ddpkit.DistributedDataParallel._get_active_ddp_module() is None  # no forward running
    with pytest.raises(ValueError, match="at least 1"):
        ddp._set_ddp_runtime_logging_sample_rate(0)
    ddp._set_ddp_runtime_logging_sample_rate(10)
    ddp._set_ddp_sink_clone(False)
    with pytest.raises(KeyError):
        ddp._log_and_throw(KeyError, "passed through")
    ddp._check_reducer_finalized()
    data = ddp._get_ddp_logging_data()
    assert data["module_name"] == "ConvBN" and data["world_size"] == 1 and data["broadcast_buffers"] == 1
    assert data["num_parameter_tensors"] == len([p for p in ddp.module.parameters() if p.requires_grad])
    assert data["dtypes"] == "float"  # c10's name, as torch's (its test_ddp_logging_data_cpu asserts it)
    assert data["master_port"] == os.environ.get("MASTER_PORT", "N/A") and "has_rebuilt_buckets" in data
    inputs, kwargs = ddp.to_kwargs((torch.ones(1),), {"a": torch.zeros(1)}, 0)
    assert inputs[0][0].device.type == "cpu" and kwargs[0]["a"].device.type == "cpu"


def test_active_ddp_module_for_dynamo():
    """Dynamo's DDPOptimizer reads torch's class attribute while the wrapped module runs."""
    import ddpkit
    from ddpkit.engine.ddp import DYNAMO_FIRST_BUCKET_BYTES

    ddp = ddpkit.DistributedDataParallel(models.MLP())
    tiny = ddpkit.DistributedDataParallel(models.MLP(), bucket_cap_mb=0.002)
    with ddp._inside_ddp_forward():
        assert TorchDDP._get_active_ddp_module() is ddp and ddp._get_active_ddp_module() is ddp
        with tiny._inside_ddp_forward():  # nested wrappers: the inner one while it runs, then the outer again
            assert TorchDDP._get_active_ddp_module().bucket_bytes_cap == DYNAMO_FIRST_BUCKET_BYTES
        assert TorchDDP._get_active_ddp_module() is ddp
    assert TorchDDP._get_active_ddp_module() is None


# -- torch's wrapper's contract where accelerate and others rely on it ---------------------------------------------
def _trigger_sync_run(wrap, model, name, r, n, find_unused):
    """Three forwards under no_sync, two plain backwards, then the third backward after accelerate's
    trigger_sync_in_backward (both flags set, reducer.prepare_for_backward([])). Gradients per iteration."""
    mine = slice(r * SHARD, (r + 1) * SHARD)
    ddp = wrap(model, bucket_cap_mb=0.002, find_unused_parameters=find_unused)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    grads = []
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        if step == 0 and find_unused:  # a plain synchronised step first: its walk must not outlive it
            models.loss(name, ddp, *models.batch(name, SHARD, seed=90), r, 0).backward()
            opt.zero_grad(set_to_none=True)
        micro = [models.batch(name, SHARD * n, seed=70 + 3 * step + k) for k in range(3)]
        with ddp.no_sync():
            losses = [models.loss(name, ddp, x[mine], y[mine], r, 1) for x, y in micro]
        losses[0].backward()
        losses[1].backward()
        old = ddp.require_backward_grad_sync, ddp.require_forward_param_sync
        ddp.require_backward_grad_sync = ddp.require_forward_param_sync = True
        ddp.reducer.prepare_for_backward([])
        losses[2].backward()
        ddp.require_backward_grad_sync, ddp.require_forward_param_sync = old
        grads.append(grads_of(ddp.module))
        opt.step()
    return grads


def trigger_sync_in_backward(world):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import ddpkit

    r, n = world.rank, world.world_size
    out = {}
    # torch's wrapper cannot take prepare_for_backward([]) with find_unused_parameters=True (its empty walk marks
    # every parameter unused, and the first gradient then raises "marked as ready twice"), nor a model with
    # unused parameters without it: the Branchy case is checked against one process only.
    for name, find_unused in (("mlp", False), ("branchy", True)):
        torch.manual_seed(6)
        model = models.make(name)
        theirs, ref = copy.deepcopy(model), copy.deepcopy(model)
        ours = _trigger_sync_run(ddpkit.DistributedDataParallel, model, name, r, n, find_unused)
        torch_grads = None if find_unused else _trigger_sync_run(TorchDDP, theirs, name, r, n, find_unused)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        worst_torch = worst_truth = 0.0
        for step in range(3):
            ref_opt.zero_grad(set_to_none=True)
            if step == 0 and find_unused:
                x0, y0 = models.batch(name, SHARD, seed=90)
                (sum(models.loss(name, ref, x0, y0, k, 0) for k in range(n)) / n).backward()
                ref_opt.zero_grad(set_to_none=True)
            for k in range(3):  # the sum of the three micro-batches' averaged losses
                x, y = models.batch(name, SHARD * n, seed=70 + 3 * step + k)
                models.truth_step(name, ref, x, y, n, 1, SHARD)
            truth = grads_of(ref)
            ref_opt.step()
            assert_close_grads(ours[step], truth, f"trigger_sync {name} step {step}")
            for key, want in truth.items():
                got = ours[step][key]
                if got is not None:
                    worst_truth = max(worst_truth, (got - want).abs().max().item())
                if torch_grads is not None:
                    theirs_g = torch_grads[step][key]
                    assert (got is None) == (theirs_g is None), f"{name} {key}: None where torch's is not"
                    if got is not None:
                        worst_torch = max(worst_torch, (got - theirs_g).abs().max().item())
        out[name] = (None if torch_grads is None else worst_torch, worst_truth, fingerprint(model))
    return out


def test_prepare_for_backward_overrides_the_forward_decision():
    """accelerate's trigger_sync_in_backward after several forwards under no_sync: the last backward reduces
    the sum of all three micro-batches, as with torch's wrapper (to 1e-6) and one process (to TOL)."""
    a, b = run_world(trigger_sync_in_backward, 2)
    for name in a:
        for res in (a, b):
            worst_torch, worst_truth, _ = res[name]
            assert (worst_torch is None) == (name == "branchy")
            assert worst_torch is None or worst_torch <= 1e-6, f"{name}: off torch's wrapper by {worst_torch:.3g}"
            assert worst_truth <= TOL, f"{name}: off single-process truth by {worst_truth:.3g}"
        assert a[name][2] == b[name][2], f"{name}: replicas diverged"


def buffers_under_no_sync(world):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import ddpkit

    r, n = world.rank, world.world_size
    mine = slice(r * SHARD, (r + 1) * SHARD)
    torch.manual_seed(7 + r)  # different on every rank: the init broadcast makes them rank 0's
    model = models.ConvBN()
    runs = {}
    for label, wrap, module in (("ddpkit", ddpkit.DistributedDataParallel, model),
                                ("torch", TorchDDP, copy.deepcopy(model))):
        ddp = wrap(module, bucket_cap_mb=0.002)
        broadcasts = []
        if label == "ddpkit":
            comm, send = ddp._comm, ddp._comm.broadcast_tensors
            comm.broadcast_tensors = lambda *a, **k: (broadcasts.append(1), send(*a, **k))[1]
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        seen = []
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            for k in range(3):
                x, y = models.batch("convbn", SHARD * n, seed=80 + 3 * step + k)
                if step == 1:  # nanoGPT's way: the flag set directly
                    ddp.require_backward_grad_sync = k == 2
                    models.loss("convbn", ddp, x[mine], y[mine], r, 0).backward()
                else:
                    with ddp.no_sync() if k < 2 else contextlib.nullcontext():
                        models.loss("convbn", ddp, x[mine], y[mine], r, 0).backward()
                seen.append([b.clone() for b in module.buffers()])
            opt.step()
        # accelerate's trigger_sync_in_backward sets require_forward_param_sync: the next forward broadcasts.
        for force in (False, False, True):
            ddp.require_forward_param_sync |= force
            with ddp.no_sync():
                models.loss("convbn", ddp, x[mine], y[mine], r, 0).backward()
            seen.append([b.clone() for b in module.buffers()])
        if label == "ddpkit":
            del comm.broadcast_tensors
        runs[label] = (seen, len(broadcasts), fingerprint(module))
    mismatches = [(i, j) for i, (ours, theirs) in enumerate(zip(runs["ddpkit"][0], runs["torch"][0]))
                  for j, (a, b) in enumerate(zip(ours, theirs)) if not torch.equal(a, b)]
    return {"mismatches": mismatches, "broadcasts": runs["ddpkit"][1], "params": runs["ddpkit"][2],
            "torch_params": runs["torch"][2], "stats": [t.tolist() for t in runs["ddpkit"][0][1]]}


def test_buffers_follow_require_forward_param_sync_like_torch():
    """BatchNorm statistics under no_sync accumulation equal torch's wrapper's bitwise: only the forward after a
    synchronised one broadcasts rank 0's buffers, so accumulation pays one broadcast per step."""
    a, b = run_world(buffers_under_no_sync, 2)
    for res in (a, b):
        assert not res["mismatches"], f"buffers differ from torch's (micro-step, buffer): {res['mismatches']}"
        # One per accumulation step (3); after them, one for the forward that follows the synchronised one, none
        # for the next, one after the flag was set.
        assert res["broadcasts"] == 5, res["broadcasts"]
    assert a["stats"] != b["stats"], "buffers were broadcast inside no_sync"
    assert a["params"] == b["params"]


def test_the_state_left_out_of_a_pickle_names_attributes_the_wrapper_sets():
    """__getstate__ leaves the process group, the reducer and their bookkeeping out by name: a renamed attribute
    must not leave a stale name behind (and its value in every pickle). Each name is one the wrapper's classes
    assign (some only on more than one rank, so their source is read rather than an instance)."""
    import inspect
    import re

    from ddpkit.engine.ddp import DistributedDataParallel

    sources = "".join(inspect.getsource(cls) for cls in DistributedDataParallel.__mro__
                      if cls.__module__.startswith("ddpkit."))
    assigned = set(re.findall(r"self\.(\w+)(?:\s*:[^=\n]+)?\s*=", sources))
    stale = [name for name in DistributedDataParallel._ENGINE_STATE if name not in assigned]
    assert not stale, f"_ENGINE_STATE names attributes the wrapper never sets: {stale}"
