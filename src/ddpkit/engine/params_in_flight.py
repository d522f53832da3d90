"""Parameters whose new values are still on the wire: the first torch function that touches one waits for them.

After a sharded step the updated shards are all-gathered straight into the parameters' memory, asynchronously,
so that the transfers run on while the caller goes on (zero_grad, the next batch, the next forward). Until a
parameter's gather is waited for, its values are stale. `hold` marks such parameters by switching their class
to `InFlight`, a subclass of nn.Parameter whose `__torch_function__` lands every in-flight parameter among a
function's arguments (waits for its gather and switches it back) before the function runs. So whatever reads
one (a layer's forward, a weight tied by hand, `p.detach()`, `p.data`, `torch.save`, an EMA after the step,
`state_dict`, the next optimizer step's foreach kernels) sees its new values, wherever it is read from, and a
parameter nobody reads costs nothing. Once landed, a parameter is a plain nn.Parameter again: reads cost
nothing more. (A torch function mode would see the same reads, but it intercepts every call, whatever its
arguments: 1 ms of a 16 ms forward of the bench transformer.)

Only exact nn.Parameter objects are held (a subclass of its own, such as a quantised weight's, is not switched
under its owner's feet): `hold` says which parameters it could not mark, and their gather must be waited for at
once. Reading `.grad` or setting it also lands a parameter; code that only clears gradients (zero_grad) can do
so without waiting inside `torch._C.DisableTorchFunctionSubclass()`. What reads parameters without torch
functions (torch.func transforms, TorchScript, a view made before the step, a C extension) or guards on their
class (torch.compile's Dynamo) must see them landed first: the owner waits for every gather there
(ddpkit.engine.sharded_grads).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

LAND = "_ddpkit_land"  # on a held parameter: what waits for its gather (and releases it)


class InFlight(nn.Parameter):
    """A parameter whose all-gather is still in flight (see the module docstring). Built as `type(p)(data)` (as
    accelerate builds parameters like another), it makes a plain nn.Parameter: only `hold` makes one of these."""

    def __new__(cls, data: Any = None, requires_grad: bool = True) -> nn.Parameter:
        return nn.Parameter(data, requires_grad)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        held = _held_in((args, kwargs))
        if not held:  # torch saw one where this walk cannot (a container of another kind): never recurse
            raise RuntimeError(f"{getattr(func, '__name__', func)} was given a parameter whose all-gather is in "
                               "flight inside a container ddpkit does not look into; wait for the gathers first "
                               "(ZeroRedundancyOptimizer.wait_for_params())")
        for param in held:
            land(param)
        return func(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Any:  # nn.Parameter's would copy this class before reading a value
        land(self)
        return self.__deepcopy__(memo)


def hold(params: Iterable[nn.Parameter], land_them: Callable[[], None]) -> list[nn.Parameter]:
    """Mark `params` in flight until `land_them()` (which must `release` them); returns those not marked."""
    unmarked = []
    for param in params:
        if type(param) is nn.Parameter:
            setattr(param, LAND, land_them)
            param.__class__ = InFlight
        else:  # a subclass of its own, or held already (its earlier gather must land first)
            unmarked.append(param)
    return unmarked


def release(params: Iterable[nn.Parameter]) -> None:
    """Their gather is in: plain parameters again."""
    for param in params:
        if type(param) is InFlight:
            param.__class__ = nn.Parameter
            param.__dict__.pop(LAND, None)


def land(param: nn.Parameter) -> None:
    """Wait for a held parameter's gather (no-op once it landed). `land_them` may run more than once for one
    hold (Dynamo replays a frame it could not trace): it must wait once and then do nothing."""
    if type(param) is InFlight:
        try:
            land_them = getattr(param, LAND, None)
            if land_them is not None:
                land_them()
        finally:
            release([param])  # a failed wait raises once, never again at every read


def _held_in(tree: Any) -> list[InFlight]:
    """The held parameters among a torch function's arguments: inside lists, tuples (their subclasses too, as
    torch's argument parser sees them) and dicts."""
    found, stack = [], [tree]
    while stack:
        item = stack.pop()
        if type(item) is InFlight:
            found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return found
