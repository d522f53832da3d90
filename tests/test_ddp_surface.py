"""torch's DistributedDataParallel surface on ddpkit's wrapper: every method is ours, refused, or safe to inherit.

The walk covers everything torch's class defines beyond nn.Module, so a method a new torch adds fails here,
by name, until it is implemented or refused (ddpkit.ddp_surface.REFUSED) or shown to need none of torch's
fields (ddpkit.ddp_surface.INHERITED).
"""

from __future__ import annotations

import dis
import inspect

import pytest
import torch
import torch.distributed.algorithms.join
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import models

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
    from ddpkit import ddp_surface

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
    from ddpkit import ddp_surface

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
    from ddpkit import ddp_surface

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
    inputs, kwargs = ddp.to_kwargs((torch.ones(1),), {"a": torch.zeros(1)}, 0)
    assert inputs[0][0].device.type == "cpu" and kwargs[0]["a"].device.type == "cpu"


def test_active_ddp_module_for_dynamo():
    """Dynamo's DDPOptimizer reads torch's class attribute while the wrapped module runs."""
    import ddpkit
    from ddpkit.ddp import DYNAMO_FIRST_BUCKET_BYTES

    ddp = ddpkit.DistributedDataParallel(models.MLP())
    tiny = ddpkit.DistributedDataParallel(models.MLP(), bucket_cap_mb=0.002)
    with ddp._inside_ddp_forward():
        assert TorchDDP._get_active_ddp_module() is ddp and ddp._get_active_ddp_module() is ddp
        with tiny._inside_ddp_forward():  # nested wrappers: the inner one while it runs, then the outer again
            assert TorchDDP._get_active_ddp_module().bucket_bytes_cap == DYNAMO_FIRST_BUCKET_BYTES
        assert TorchDDP._get_active_ddp_module() is ddp
    assert TorchDDP._get_active_ddp_module() is None
