"""Optimizer state between its shards and torch's whole format.

A rank's local optimizer keys its state by its local tensors: flat slices [start, stop) of parameters (or whole
parameters under a shape-aware optimizer). A *shard state* names each of them by (global parameter index,
start, stop) instead, which any world size and any partition can read:

    merge_pieces(pieces, shape, whole)              one parameter's whole state from its pieces
    whole_state_dict(pieces, params, groups, whole) torch's state_dict from every rank's pieces
    whole_pieces(state, shapes)                     torch's "state" as pieces, each a whole parameter's, flat
    slice_state(state, start, stop, shape, whole)   the piece of one parameter's whole state a rank needs
    local_state_dict(pieces, groups, local_groups, slot)  a rank's pieces as its local optimizer's state_dict

torch's rule decides what is per element: every tensor shaped like the parameter is, except "step", which is a
count (torch's Optimizer.load_state_dict makes the same exception).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

COUNT_KEYS = ("step",)


def _per_element(key: Any, value: Any, shape: torch.Size | None) -> bool:
    """torch's rule: a state tensor shaped like its parameter holds one value per element ("step" aside)."""
    return shape is not None and isinstance(value, torch.Tensor) and key not in COUNT_KEYS and \
        tuple(value.shape) == tuple(shape)


def merge_pieces(pieces: list[tuple[int, int, dict]], shape: torch.Size, whole: bool) -> dict[str, Any]:
    """One parameter's whole state from its pieces [(start, stop, state)], given in any order."""
    pieces = sorted(pieces, key=lambda p: p[0])
    first = pieces[0][2]
    if whole:
        return dict(first)
    merged: dict[str, Any] = {}
    for key, value in first.items():
        if key not in COUNT_KEYS and isinstance(value, torch.Tensor) and value.dim() == 1 and \
                value.numel() == pieces[0][1] - pieces[0][0]:
            merged[key] = torch.cat([state[key] for _, _, state in pieces]).view(shape)
        else:
            merged[key] = value  # a count (the same in every piece: they all stepped together) or a number
    return merged


def slice_state(state: dict[str, Any], start: int, stop: int, shape: torch.Size, whole: bool) -> dict[str, Any]:
    """The part of one parameter's whole state that covers its flat elements [start, stop)."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if not whole and _per_element(key, value, shape):
            out[key] = value.reshape(-1)[start:stop].clone()
        elif isinstance(value, torch.Tensor):
            out[key] = value.clone()
        else:
            out[key] = value
    return out


def whole_state_dict(pieces: list[tuple[int, int, int, dict]], params: list[torch.Tensor], param_groups: list[dict],
                     whole: bool) -> dict[str, Any]:
    """torch's state_dict format (parameters numbered in param-group order) from the pieces of every rank's shard
    state [(parameter index, start, stop, state)]; `params`, numbered so, give each its shape."""
    by_param: dict[int, list[tuple[int, int, dict]]] = {}
    for index, start, stop, state in pieces:
        by_param.setdefault(index, []).append((start, stop, state))
    merged = {index: merge_pieces(by_param[index], params[index].shape, whole) for index in sorted(by_param)}
    groups, at = [], 0
    for group in param_groups:
        n = len(group["params"])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(range(at, at + n))})
        at += n
    return {"state": merged, "param_groups": groups}


def flat_state(state: dict[str, Any], numel: int) -> dict[str, Any]:
    """A piece's state with every per-element tensor (`numel` elements) flat, as the checkpoints hold it."""
    return {k: v.detach().reshape(-1) if isinstance(v, torch.Tensor) and k not in COUNT_KEYS and v.dim() > 0
            and v.numel() == numel else v for k, v in state.items()}


def whole_pieces(state: dict[Any, dict[str, Any]], shapes: list[torch.Size]
                 ) -> list[tuple[int, int, int, dict[str, Any]]]:
    """torch's state_dict["state"] as shard-state pieces: (parameter index, 0, numel, its state with every
    per-element tensor made flat). `shapes`: the parameters' (numbered in param-group order): torch's rule, a
    tensor shaped like its parameter is per element (so a 0-dim parameter's are too, and a shape-aware
    optimizer's factored statistics are not); a parameter past them (a mismatch the caller reports) is taken
    as it is."""
    pieces = []
    for index, saved in state.items():
        shape = shapes[int(index)] if int(index) < len(shapes) else None
        flat = {k: v.detach().reshape(-1) if _per_element(k, v, shape) else v for k, v in saved.items()}
        pieces.append((int(index), 0, shape.numel() if shape is not None else 0, flat))
    return pieces
def local_state_dict(pieces: list[tuple[int, int, int, dict[str, Any]]], groups: list[dict[str, Any]],
                     local_groups: list[dict[str, Any]], slot: Callable[[torch.Tensor], tuple[int, int, int]]
                     ) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]]]:
    """The ("state", "param_groups") of a rank's local optimizer, whose groups are `local_groups` (each local
    tensor named by slot(tensor): (parameter index, start, stop)), from its pieces [(parameter index, start,
    stop, state)] and the hyperparameters of `groups`; per-element tensors may come flat."""
    by_range = {(index, start, stop): state for index, start, stop, state in pieces}
    local_state, numbered, position = {}, [], 0
    for group, local in zip(groups, local_groups):
        numbers = []
        for tensor in local["params"]:
            state = by_range.get(slot(tensor))
            if state is not None:
                local_state[position] = {k: v.view(tensor.shape) if isinstance(v, torch.Tensor) and
                                         k not in COUNT_KEYS and v.numel() == tensor.numel() and v.dim() > 0
                                         else v for k, v in state.items()}
            numbers.append(position)
            position += 1
        numbered.append({**{k: v for k, v in group.items() if k != "params"}, "params": numbers})
    return local_state, numbered
