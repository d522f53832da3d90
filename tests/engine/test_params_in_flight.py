"""ddpkit.engine.params_in_flight: a held parameter's first read, whatever makes it, waits for its gather; clearing .grad does not.
And the gathers' owner (ddpkit.engine.sharded_grads.GradShards), on an accelerator: a first read on a side stream orders the
step's stream after it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ddpkit.engine.params_in_flight import InFlight, hold, land, release
from helpers.models import save_and_load


def _held(module: nn.Module, fail: bool = False):
    """Hold the module's parameters as if their gather were in flight: landing writes their new values (what
    the gather brings, here the old ones + 1) and counts itself. Returns the new values and the count."""
    params = list(module.parameters())
    new = [p.detach() + 1 for p in params]
    calls = []

    def land_them():
        calls.append(1)
        release(params)
        if fail:
            raise RuntimeError("the gather timed out")
        with torch.no_grad():
            for param, value in zip(params, new):
                param.copy_(value)

    assert hold(params, land_them) == []
    assert all(type(p) is InFlight and isinstance(p, nn.Parameter) for p in params)
    return new, calls


READS = {
    "forward": lambda m: m(torch.ones(2, 3)).detach(),
    "detach": lambda m: m.weight.detach().clone(),
    "data": lambda m: m.weight.data.clone(),
    "arithmetic": lambda m: (m.weight + 0).detach(),
    "foreach": lambda m: torch._foreach_mul([m.weight, m.bias], 1.0)[0].detach(),
    "state_dict": lambda m: m.state_dict()["weight"].clone(),
    "deepcopy": lambda m: copy.deepcopy(m).weight.detach(),
    "torch.save": lambda m: _roundtrip(m.weight).detach(),
    "item": lambda m: torch.tensor(m.weight[0, 0].item()),
}


def _roundtrip(tensor):
    loaded = save_and_load(tensor)
    assert type(loaded) is nn.Parameter, type(loaded)
    return loaded


@pytest.mark.parametrize("read", sorted(READS))
def test_a_read_waits_for_the_gather_and_sees_the_new_values(read):
    torch.manual_seed(0)
    module = nn.Linear(3, 2)
    reference = copy.deepcopy(module)
    new, calls = _held(module)
    with torch.no_grad():
        for param, value in zip(reference.parameters(), new):
            param.copy_(value)
    got = READS[read](module)
    assert calls == [1]
    assert torch.equal(got, READS[read](reference)), read
    assert all(type(p) is nn.Parameter for p in module.parameters())
    READS[read](module)
    assert calls == [1], "a landed parameter waits no more"


def test_autograd_runs_through_a_landed_parameter():
    module = nn.Linear(3, 2)
    new, _ = _held(module)
    module(torch.ones(1, 3)).sum().backward()
    assert torch.equal(module.weight.grad, torch.ones(2, 3)) and torch.equal(module.weight, new[0])


def test_clearing_grad_without_torch_functions_does_not_wait():
    module = nn.Linear(3, 2)
    module(torch.ones(1, 3)).sum().backward()
    _, calls = _held(module)
    with torch._C.DisableTorchFunctionSubclass():
        for param in module.parameters():
            param.grad = None
    assert calls == [] and type(module.weight) is InFlight
    land(module.weight)
    land(module.weight)
    assert calls == [1] and module.weight.grad is None


def test_a_failed_gather_raises_once():
    module = nn.Linear(3, 2)
    _, calls = _held(module, fail=True)
    with pytest.raises(RuntimeError, match="timed out"):
        module(torch.ones(1, 3))
    module(torch.ones(1, 3))
    assert calls == [1] and type(module.bias) is nn.Parameter


def test_hold_leaves_subclasses_and_held_parameters_to_the_caller():
    class Quantised(nn.Parameter):
        pass

    plain, odd = nn.Parameter(torch.zeros(2)), Quantised(torch.zeros(2))
    assert hold([plain, odd], lambda: release([plain])) == [odd]
    assert hold([plain], lambda: None) == [plain], "held already: its first gather must land first"
    assert type(odd) is Quantised and type(plain) is InFlight
    land(plain)
    assert type(plain) is nn.Parameter


def test_reads_inside_list_subclasses_land_and_copies_by_type_are_plain():
    class Row(list):
        pass

    module = nn.Linear(3, 2)
    new, calls = _held(module)
    got = torch.cat(Row([module.weight.view(-1), module.bias]))
    assert calls == [1] and torch.equal(got, torch.cat([new[0].view(-1), new[1]]))
    _held(module)
    made = type(module.weight)(torch.zeros(2))  # how accelerate builds a parameter like another
    assert type(made) is nn.Parameter and type(module.weight) is InFlight


def test_an_unlandable_parameter_is_a_clear_error():
    module = nn.Linear(3, 2)
    _held(module)

    class Box:
        def __init__(self, value):
            self.value = value

    with pytest.raises(RuntimeError, match="inside a container"):  # torch saw it, the walk cannot: no recursion
        InFlight.__torch_function__(torch.add, (InFlight,), (Box(module.weight), 1))


class _Stream:
    """Stands for an accelerator stream: which streams it was made to wait for."""

    def __init__(self, name):
        self.name, self.waited_for = name, []

    def wait_stream(self, other):
        self.waited_for.append(other.name)


class _Unit:
    def __init__(self, params):
        self.params, self.finished = params, 0

    def finish_gather(self, handle):
        self.finished += 1


def test_a_gather_first_waited_for_on_a_side_stream_orders_the_step_stream_too(monkeypatch):
    """On an accelerator a wait orders only the current stream. When the first read of a held bucket comes on
    a side stream, the stream the step ran on must wait for that one too: released parameters wait no more,
    so the next forward, on the step's stream, would otherwise read them before the gather is in. (CI has no
    accelerator: the streams here are stand-ins, and this checks who is made to wait for whom.)"""
    import ddpkit.engine.sharded_grads as zero_grads
    from ddpkit.distributed.comm import Comm

    module = nn.Linear(2, 2)
    shards = zero_grads.GradShards(module, list(module.parameters()), Comm())
    step_stream, side_stream = _Stream("step"), _Stream("side")
    current = [step_stream]
    monkeypatch.setattr(zero_grads, "_current_stream", lambda device: current[0])
    for first_read_on, expected in ((side_stream, ["side"]), (step_stream, [])):
        step_stream.waited_for.clear()
        unit = _Unit(list(module.parameters()))
        current[0] = step_stream
        shards.add_gather(0, unit, handle=object())  # issued on the step's stream
        current[0] = first_read_on
        module.weight.detach()  # the first read lands the bucket
        assert unit.finished == 1 and not shards.gathers
        assert all(type(p) is nn.Parameter for p in module.parameters())
        assert step_stream.waited_for == expected, (first_read_on.name, step_stream.waited_for)
    assert side_stream.waited_for == []
