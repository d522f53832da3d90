"""Which rank owns which elements of which parameter: the pure half of ZeRO's sharding (no processes).

A *unit* is the parameters of one param group that share a dtype and device, in group order, seen as one flat
sequence of elements. It is cut into `world_size` equal *segments* of `segment_numel` elements (the last ones
padded with nothing), one per rank; a segment holds *pieces*, each a flat range [start, stop) of one parameter.
Two ways to cut:

    partition_flat   balanced to the element: segment r is elements [r * S, (r + 1) * S) of the unit, with
                     S = ceil(total / N); a parameter may be split between neighbouring ranks. For optimizers
                     that treat every element on its own (SGD, Adam, AdamW, ...).
    partition_whole  whole parameters, greedily to the least loaded rank (largest first); S is the largest
                     load. For optimizers that need a tensor's shape (Adafactor's row and column statistics).

A parameter of 0 elements has no element to own, yet the unsharded optimizer keeps state for it once it has a
gradient (AdamW's step count and empty moments): `place_empty` gives each such parameter one piece of 0 elements,
on one rank, so that some rank's optimizer steps it and its state is saved and loaded as any other's.

Either way, element e of piece (param, start, stop, offset) of rank r lies at `r * S + offset + (e - start)` of
the gathered flat buffer, and the pieces of one parameter are adjacent there (one contiguous run), so a
parameter can be a view into that buffer (parameters_as_bucket_view).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of the unit's parameter `param` (flattened), at `offset` in its owner's segment."""

    param: int
    start: int
    stop: int
    offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class Partition:
    numels: tuple[int, ...]
    segments: tuple[tuple[Piece, ...], ...]  # per rank
    segment_numel: int
    whole: bool

    @property
    def world_size(self) -> int:
        return len(self.segments)

    def owned_numel(self, rank: int) -> int:
        return sum(piece.numel for piece in self.segments[rank])

    def param_start(self) -> list[int]:
        """Where each parameter's first element lies in the gathered buffer (world_size * segment_numel)."""
        start = [0] * len(self.numels)
        for rank in reversed(range(self.world_size)):  # reversed: a split parameter keeps its first piece's place
            for piece in reversed(self.segments[rank]):
                if piece.start == 0:
                    start[piece.param] = rank * self.segment_numel + piece.offset
        return start

    def owner_ranges(self) -> list[list[tuple[int, int, int]]]:
        """Per parameter, (rank, start, stop) of each piece, in element order."""
        out: list[list[tuple[int, int, int]]] = [[] for _ in self.numels]
        for rank, segment in enumerate(self.segments):
            for piece in segment:
                out[piece.param].append((rank, piece.start, piece.stop))
        for ranges in out:
            ranges.sort(key=lambda r: r[1])
        return out


def partition_flat(numels: Sequence[int], world_size: int) -> Partition:
    """Equal flat segments: every rank owns ceil(total / N) elements but the last ones, which own what is left."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    total = sum(numels)
    size = -(-total // world_size)
    segments = []
    for rank in range(world_size):
        lo, hi = rank * size, min((rank + 1) * size, total)
        pieces, at = [], 0
        for index, n in enumerate(numels):
            begin, end = max(lo, at), min(hi, at + n)
            if begin < end:
                pieces.append(Piece(index, begin - at, end - at, begin - lo))
            at += n
        segments.append(tuple(pieces))
    return place_empty(Partition(tuple(numels), tuple(segments), size, whole=False))


def partition_whole(numels: Sequence[int], world_size: int) -> Partition:
    """Whole parameters, largest first to the least loaded rank (lowest rank on ties): the same on every rank."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    load = [0] * world_size
    owner = [0] * len(numels)
    for index in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[index] = rank
        load[rank] += numels[index]
    segments = []
    for rank in range(world_size):
        pieces, at = [], 0
        for index, n in enumerate(numels):
            if owner[index] == rank:  # a parameter of 0 elements too: a piece of 0 elements, as place_empty's
                pieces.append(Piece(index, 0, n, at))
                at += n
        segments.append(tuple(pieces))
    return Partition(tuple(numels), tuple(segments), max(load) if load else 0, whole=True)


def place_empty(plan: Partition) -> Partition:
    """`plan` (a flat one: partition_flat's, or a stage-2 bucket's, laid out alike) with a piece of 0 elements for
    every parameter of 0 elements that has none: on the rank whose segment holds the unit's next element at that
    place (the last rank at the end; rank 0 in a unit of no elements), at that offset of its segment."""
    held = {piece.param for segment in plan.segments for piece in segment}
    empty = [index for index, n in enumerate(plan.numels) if n == 0 and index not in held]
    if not empty:
        return plan
    segments = [list(segment) for segment in plan.segments]
    size = plan.segment_numel
    for index in empty:
        at = sum(plan.numels[:index])  # where its elements would begin in the unit
        rank = min(at // size, plan.world_size - 1) if size else 0
        segments[rank].append(Piece(index, 0, 0, at - rank * size))
    ordered = tuple(tuple(sorted(segment, key=lambda piece: (piece.offset, piece.param))) for segment in segments)
    return dataclasses.replace(plan, segments=ordered)


# Stage 1 cuts each param group and dtype into units of at least this many bytes of whole parameters, so that
# the all-gather of one unit runs while the next one steps (stage 2's units are the reducer's buckets). 4 MiB:
# the stage-1 step of the bench MLP (6.3M parameters, AdamW, 2 gloo ranks) took 57 ms, against 69 ms uncut,
# 70 ms at 8 MiB and 61 ms at 2 MiB (medians of 12 steps, one interleaved run, load average 2.4 on 2 cores).
CHUNK_BYTES = 4 << 20


def chunk_positions(params: Sequence, positions: Sequence[int], cap_bytes: int | None = None) -> list[list[int]]:
    """`positions` (indices into `params`, in order) in runs closed once they hold at least `cap_bytes`
    (None: CHUNK_BYTES, read at each call)."""
    cap_bytes = CHUNK_BYTES if cap_bytes is None else cap_bytes
    chunks: list[list[int]] = [[]]
    held = 0
    for position in positions:
        if held >= cap_bytes:
            chunks.append([])
            held = 0
        chunks[-1].append(position)
        held += params[position].numel() * params[position].element_size()
    return [chunk for chunk in chunks if chunk]
