"""Sharded optimizer checkpoints: each rank writes its own slices, each rank reads only the slices it needs.

    write_shard(folder, optimizer, rank, n)   optimizer_shard_<rank>.pt: this rank's state, by flat element range
    read_into(folder, optimizer)              a ZeroRedundancyOptimizer (any stage, any world size) or a plain one

A shard file holds {"format", "world_size", "param_groups", "pieces"}: each piece is (parameter index, start,
stop, state) with the parameters numbered in param-group order (torch's state_dict numbering) and every
per-element tensor flat over elements [start, stop) of its parameter. So the file says nothing about the
partition that wrote it: a run saved on 2 ranks under stage 2 (bucket shards) resumes on 3 under stage 1 (flat
shards), or on 1 with the plain optimizer. Files are opened with torch.load(mmap=True): only the byte ranges a
rank copies are read from disk, so no rank ever holds the whole optimizer state; the plain optimizer, which
holds it all by definition, is the one exception. A plain optimizer's whole state_dict (optimizer.pt) is read
the same way by a sharded one.
"""

from __future__ import annotations

import functools
import glob
import os
import re
from typing import Any

import torch

from ddpkit.checkpoint.integrity import write_checksummed, write_failure
from ddpkit.zero.optimizer_state import COUNT_KEYS, flat_state, whole_pieces

SHARD_FILE = "optimizer_shard_{rank}.pt"
FORMAT = 1


def is_sharded(optimizer: Any) -> bool:
    return hasattr(optimizer, "shard_state") and hasattr(optimizer, "load_shard_state")


def write_shard(folder: str, optimizer: Any, rank: int, world_size: int) -> tuple[str, int]:
    """This rank's pieces of the optimizer state into `folder` (every rank calls it, into the same folder); the
    file's name and the CRC-32 of its bytes, for the completion marker."""
    pieces = [(index, start, stop, flat_state(state, stop - start))
              for index, start, stop, state in optimizer.shard_state()]
    groups = [{k: v for k, v in g.items() if k != "params"} | {"count": len(g["params"])}
              for g in optimizer.param_groups]
    name = SHARD_FILE.format(rank=rank)
    saved = {"format": FORMAT, "world_size": world_size, "param_groups": groups, "pieces": pieces}
    return name, write_checksummed(os.path.join(folder, name), functools.partial(torch.save, saved))


def shard_index(name: str) -> int | None:
    """The rank a file name is the optimizer shard of (optimizer_shard_<rank>.pt), or None for another file."""
    match = re.fullmatch(r"optimizer_shard_(\d+)\.pt", os.path.basename(name))
    return int(match.group(1)) if match else None


def shard_files(folder: str) -> list[str]:
    found = []
    for path in glob.glob(os.path.join(folder, "optimizer_shard_*.pt")):
        match = re.search(r"optimizer_shard_(\d+)\.pt$", path)
        if match:
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def _open(path: str) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def _saved_pieces(folder: str, whole_file: str | None, shapes: list[torch.Size]
                  ) -> tuple[list[dict], list[tuple[int, int, int, dict]]]:
    """The saved param groups and pieces, from shard files or from one whole state_dict (lazily: mmap); `shapes`:
    the loading optimizer's parameters', which tell the whole state's per-element tensors (zero_state)."""
    files = shard_files(folder)
    if files:
        pieces, groups = [], None
        for path in files:
            saved = _open(path)
            groups = groups or saved["param_groups"]
            pieces.extend(saved["pieces"])
        return groups, pieces
    if whole_file is None or not os.path.isfile(whole_file):
        raise FileNotFoundError(f"{folder} holds no optimizer state (neither {SHARD_FILE.format(rank='<r>')} "
                                f"nor {whole_file})")
    saved = _open(whole_file)
    groups = [{k: v for k, v in g.items() if k != "params"} | {"count": len(g["params"])}
              for g in saved["param_groups"]]
    return groups, whole_pieces(saved["state"], shapes)


def _assemble(want: tuple[int, int, int], pieces_of: dict[int, list]) -> dict[str, Any] | None:
    """The state of elements [start, stop) of a parameter, copied out of whichever saved pieces cover them."""
    index, start, stop = want
    saved = pieces_of.get(index, ())
    # A parameter of 0 elements: its one piece covers no element, yet holds its state (zero_partition.place_empty)
    covering = [p for p in saved if p[1] < stop and p[2] > start] if stop > start else saved[:1]
    if not covering:
        return None
    out: dict[str, Any] = {}
    for key, value in covering[0][3].items():
        if isinstance(value, torch.Tensor) and key not in COUNT_KEYS and value.dim() == 1 and \
                value.numel() == covering[0][2] - covering[0][1]:
            flat = torch.empty(stop - start, dtype=value.dtype)
            for _, lo, hi, state in covering:
                a, b = max(lo, start), min(hi, stop)
                flat[a - start:b - start].copy_(state[key][a - lo:b - lo])  # reads only these bytes
            out[key] = flat
        else:
            out[key] = value.clone() if isinstance(value, torch.Tensor) else value
    return out


def foreign_state(optimizer: Any, group: Any) -> str | None:
    """What shows a saved param group to be another optimizer's than `optimizer` (None: it fits): torch's
    load_state_dict takes any groups of the right sizes, and the first step then fails inside the optimizer (SGD's
    KeyError 'momentum' for an AdamW state). Flags (booleans, None: foreach, fused, ...) may be missing: torch
    fills them in for a state an older version saved."""
    needed = {key for key, value in optimizer.defaults.items() if not isinstance(value, bool) and value is not None}
    missing = sorted(needed - set(group)) if isinstance(group, dict) else []
    if not missing:
        return None
    held = ", ".join(sorted(set(group) - {"params", "count"}))
    return (f"the state of another optimizer than this {type(optimizer).__name__}: its param groups lack "
            f"{', '.join(missing)} (they hold {held}). Resume with the optimizer the checkpoint was written with "
            "(--optim), or start without resume_from_checkpoint")


def read_into(folder: str, optimizer: Any, whole_file: str | None = None) -> None:
    """Load the saved state into `optimizer`: a sharded one reads its own ranges, a plain one everything."""
    # Opened now (mmap), not when a stage-2 load deferred to the first step runs: a save before that step may
    # replace this very folder, and the optimizer hands these pieces to it meanwhile.
    shapes = [p.shape for group in optimizer.param_groups for p in group["params"]]
    groups, pieces = _saved_pieces(folder, whole_file, shapes)
    foreign = foreign_state(optimizer, groups[0]) if groups else None
    if foreign:
        raise ValueError(f"it holds {foreign}")
    mine = [g["count"] for g in groups]
    theirs = [len(g["params"]) for g in optimizer.param_groups]
    if mine != theirs:
        raise ValueError(f"the checkpoint's optimizer has {mine} parameters per param group, this one {theirs}: "
                         "resume with the same model and optimizer grouping")
    if is_sharded(optimizer) and optimizer.defer_load(lambda: _load(groups, pieces, optimizer), pieces, groups):
        return
    _load(groups, pieces, optimizer)


def _load(groups: list[dict], pieces: list[tuple[int, int, int, dict]], optimizer: Any) -> None:
    pieces_of: dict[int, list] = {}
    for piece in pieces:
        pieces_of.setdefault(piece[0], []).append(piece)
    hyper = [{k: v for k, v in g.items() if k != "count"} for g in groups]
    if is_sharded(optimizer):
        wanted = optimizer.wanted_ranges()
        loaded = [(index, start, stop, state) for (index, start, stop) in wanted
                  if (state := _assemble((index, start, stop), pieces_of)) is not None]
        optimizer.load_shard_state(loaded, hyper)
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for index, param in enumerate(params):
        got = _assemble((index, 0, param.numel()), pieces_of)
        if got is not None:
            state[index] = {k: v.view(param.shape) if isinstance(v, torch.Tensor) and k not in COUNT_KEYS
                            and v.numel() == param.numel() and v.dim() == 1 else v for k, v in got.items()}
    numbered, at = [], 0
    for group, saved in zip(optimizer.param_groups, hyper):
        numbered.append({**saved, "params": list(range(at, at + len(group["params"])))})
        at += len(group["params"])
    optimizer.load_state_dict({"state": state, "param_groups": numbered})


def stage_shards(tmp: str, optimizer: Any, comm: Any, is_main: bool,
                 prepare: Any = None) -> tuple[list[tuple[int, str]], dict[str, int]]:
    """checkpoint.save_checkpoint's hook: rank 0 runs `prepare` (clears stale folders) and makes the temporary
    folder, every rank writes its shard into it, and every rank learns whether all of them could, so that a
    failure on any rank raises on every rank instead of leaving the others waiting.

    Returns the failures, (rank, what went wrong: a full disk in plain words, integrity.write_failure), and every
    shard file's CRC-32 by name, which rank 0 writes into the completion marker: one gather carries both."""
    output_dir = os.path.dirname(tmp) or "."
    error = None
    if is_main:
        try:
            os.makedirs(output_dir, exist_ok=True)
            if prepare is not None:
                prepare()
            os.makedirs(tmp)
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it, below
            error = write_failure(exc, output_dir)
    error = comm.broadcast_object(error, src=0, what="optimizer shards folder")
    if error is not None:
        return [(0, error)], {}
    written = None
    try:
        written = write_shard(tmp, optimizer, comm.rank, comm.world_size)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it, below
        error = write_failure(exc, output_dir)
    outcomes = comm.all_gather_object((error, written), what="optimizer shards written")
    failures = [(rank, text) for rank, (text, _) in enumerate(outcomes) if text is not None]
    return failures, dict(written for _, written in outcomes if written is not None)
