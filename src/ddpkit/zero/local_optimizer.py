"""The local optimizer of a ZeroRedundancyOptimizer shard: which optimizer classes can step flat slices, and the
options its param groups run with.

torch's elementwise optimizers step a flat slice of a tensor exactly as they step those elements of the whole
tensor (ELEMENTWISE); a few need every parameter at once and cannot be sharded (WHOLE_MODEL).

On the CPU torch's optimizers loop over their tensors one by one unless told `foreach=True` (on accelerators
foreach is already torch's default). A rank's shard is many flat slices, so the loop's per-tensor overhead is
a large part of a sharded step: for the bench's 500-tensor model (`ManySmall`, AdamW, 2 gloo ranks) the local
step took 7.4 ms a step looping and 4.0-4.4 ms with foreach; for the bench transformer 3.0-3.2 against 2.8-2.9.
So where the caller left `foreach` unset and the foreach path computes the same bits, the local optimizer runs
it: Adam and AdamW on float32 and float64 CPU tensors, where tests/zero/test_local_optimizer.py checks the two paths
bitwise for every option. Everything else keeps the loop:
- float16, where the two paths' optimizer states part within a few steps (not traced further), and bfloat16,
  which matched in a scratch check but is reduced precision too and not covered by the test;
- SGD, whose foreach path with nesterov adds the momentum into the .grad in place, and which with momentum in
  bfloat16 rounds differently;
- any other class (a subclass of Adam too: it may step otherwise), and groups with fused, differentiable,
  capturable or a tensor lr or betas.
The param_groups the caller sees keep its `foreach` (None), so state_dict reads as the unsharded optimizer's.

Around each local step the options travel both ways, as in torch's class: the caller's groups down into the
local optimizer's (a scheduler sets the lr on the caller's), and after the step whatever the local step wrote into
its groups (an optimizer that adapts its lr, a key of its own) back up (`copy_down`, `copy_up`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

# Optimizers whose update of an element reads only that element's parameter, gradient and state: a flat slice
# of a tensor steps exactly as that part of the whole tensor would.
ELEMENTWISE = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "NAdam", "RAdam", "ASGD", "Rprop"))
# Optimizers that need every parameter at once (global dot products), which no partition can serve.
WHOLE_MODEL = (torch.optim.LBFGS,)


def gets_whole_parameters(optimizer_class: Any) -> bool:
    """Whether the shards of `optimizer_class` are whole parameters (True) or flat slices; what cannot be sharded
    raises. A factory (a function that builds an optimizer, which torch's class accepts too) is not known to step
    elementwise: whole parameters, balanced greedily. functools.partial of a class follows that class's rules."""
    if isinstance(optimizer_class, functools.partial) and isinstance(optimizer_class.func, type):
        return gets_whole_parameters(optimizer_class.func)  # partial(AdamW, betas=...): AdamW's rules
    if not isinstance(optimizer_class, type):
        if not callable(optimizer_class):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass (e.g. torch.optim.AdamW) or "
                            f"a function that builds one from (params, **defaults), got {optimizer_class!r}")
        return True
    if not issubclass(optimizer_class, torch.optim.Optimizer):
        raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass (e.g. torch.optim.AdamW), got "
                        f"{optimizer_class!r}")
    if issubclass(optimizer_class, WHOLE_MODEL):
        raise ValueError(f"{optimizer_class.__name__} needs the gradients of all parameters at once (global dot "
                         "products and line searches), which a sharded optimizer cannot give it; use it unsharded")
    return not issubclass(optimizer_class, ELEMENTWISE)


def name_of(optimizer_class: Any) -> str:
    return getattr(optimizer_class, "__name__", None) or repr(optimizer_class)


FOREACH_CLASSES = (torch.optim.Adam, torch.optim.AdamW)  # exactly these classes: a subclass may step otherwise
FOREACH_DTYPES = (torch.float32, torch.float64)
# Options under which torch's foreach path is not the loop's arithmetic, or refuses (a tensor lr or betas needs
# capturable=True with foreach).
_EXCLUSIVE = ("fused", "differentiable", "capturable")


def foreach_tensors(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether a local param group's tensors are all ones the foreach path may step (CPU, FOREACH_DTYPES)."""
    return all(t.device.type == "cpu" and t.dtype in FOREACH_DTYPES for t in tensors)


def runs_foreach(optimizer_class: type, group: dict[str, Any], tensors_ok: bool) -> bool:
    """Whether the local param group `group` (its options as the caller set them) steps with foreach=True.
    tensors_ok: `foreach_tensors` of its tensors (they do not change: the caller keeps it)."""
    if optimizer_class not in FOREACH_CLASSES or not tensors_ok:
        return False
    if group.get("foreach") is not None or any(group.get(key) for key in _EXCLUSIVE):
        return False
    betas = group.get("betas", ())
    return not any(isinstance(v, torch.Tensor) for v in (group.get("lr"), *betas))


def copy_down(optimizer_class: type, groups: list[dict], local_groups: list[dict],
              tensors_ok: list[bool]) -> list[bool]:
    """The caller's options into the local groups, foreach chosen where `runs_foreach`; which groups it was."""
    chosen = []
    for group, local, ok in zip(groups, local_groups, tensors_ok):
        local.update((key, value) for key, value in group.items() if key != "params")
        chosen.append(runs_foreach(optimizer_class, group, ok))
        if chosen[-1]:
            local["foreach"] = True  # the same bits, without the per-tensor loop
    return chosen


def copy_up(groups: list[dict], local_groups: list[dict], chosen: list[bool]) -> None:
    """What the local step wrote into its groups, back into the caller's (but a foreach ddpkit chose)."""
    for group, local, foreach in zip(groups, local_groups, chosen):
        group.update((key, value) for key, value in local.items()
                     if key != "params" and not (foreach and key == "foreach"))
