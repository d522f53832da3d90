"""A DistributedSampler with torch's semantics that can also resume mid-epoch, onto any number of replicas.

    sampler = ddpkit.DistributedSampler(dataset, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)
    sampler.load_state_dict(checkpoint["sampler"])        # optional: continue where a run stopped
    for epoch in range(start_epoch, epochs):
        sampler.set_epoch(epoch)                          # same epoch as the checkpoint: keeps its position
        for batch in loader:
            ...
            checkpoint["sampler"] = sampler.state_dict()

Started from position 0 it yields exactly what torch.utils.data.DistributedSampler yields for the same
arguments. The arithmetic lives in `shard_indices`, a pure function of plain numbers.

How an epoch is laid out
------------------------
* The epoch's global order is a permutation of range(N) only (N = len(dataset)), drawn from a generator
  seeded with seed + epoch, so every rank draws the same one and it does not depend on the world size.
* A global position p >= N is padding and means order[p % N]: padding repeats the order from its start,
  cyclically if it is longer than the order (torch's rule).
* `consumed` = c is the number of global positions already handed out in this epoch (padding included).
  The rest of the epoch is positions c, c+1, ..., c+T-1 where, with left = max(N - c, 0) real samples:
      without drop_last: T = ceil(left / R) * R   (pad with fewer than R repeats so every rank gets T/R)
      with drop_last:    T = floor(left / R) * R  (drop the last left % R samples instead)
  and rank r takes positions c + r, c + r + R, c + r + 2R, ...
* For c = 0 this is torch's layout. At a batch boundary every rank has taken the same number of indices,
  so c is a multiple of the R that ran; resuming with that same R, ceil((N - c) / R) * R = ceil(N / R) * R - c,
  so the resumed positions, and each rank's share of them, are exactly the tail of the uninterrupted epoch.
  Resuming with another R re-splits the unseen real samples order[c:] evenly; only the new padding repeats.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

__all__ = ["DistributedSampler", "epoch_order", "remaining_positions", "shard_indices"]


def _as_int(value: Any, name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None


def _check(dataset_len: int, num_replicas: int, rank: int, drop_last: bool, consumed: int = 0) -> None:
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank {rank} is outside [0, {num_replicas}): a world of {num_replicas} replicas "
                         f"has ranks 0..{num_replicas - 1}")
    if dataset_len < 0:
        raise ValueError(f"dataset length must be >= 0, got {dataset_len}")
    if drop_last and 0 < dataset_len < num_replicas:  # an empty data set gives every replica nothing, as torch
        raise ValueError(
            f"with drop_last=True a data set of {dataset_len} samples split over {num_replicas} replicas gives "
            f"every replica an empty shard; pass drop_last=False (short shards are padded by repeating samples), "
            f"use at most {dataset_len} replicas, or use a larger data set")
    if consumed < 0:
        raise ValueError(f"consumed must be >= 0 (global samples already taken this epoch), got {consumed}")


def epoch_order(dataset_len: int, shuffle: bool = True, seed: int = 0, epoch: int = 0) -> torch.Tensor:
    """The epoch's global order of sample indices: a permutation of range(dataset_len), without padding.

    Seeded with seed + epoch, as torch's sampler is, so every rank computes the same permutation.
    """
    if not shuffle:
        return torch.arange(dataset_len)
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(dataset_len, generator=generator)


def remaining_positions(dataset_len: int, num_replicas: int, consumed: int = 0, drop_last: bool = False) -> int:
    """How many global positions are left in the epoch after `consumed`: a multiple of num_replicas."""
    if consumed < 0:
        raise ValueError(f"consumed must be >= 0 (global samples already taken this epoch), got {consumed}")
    left = max(dataset_len - consumed, 0)  # real samples not yet handed out; padding before c is already spent
    if drop_last:
        return left // num_replicas * num_replicas  # drop the last left % R samples
    return -(-left // num_replicas) * num_replicas  # ceil: pad with fewer than R repeats of the order's start


def shard_indices(dataset_len: int, num_replicas: int, rank: int, shuffle: bool = True, seed: int = 0,
                  epoch: int = 0, consumed: int = 0, drop_last: bool = False,
                  order: torch.Tensor | None = None) -> list[int]:
    """The sample indices rank `rank` of `num_replicas` takes for the rest of `epoch`, from global position
    `consumed` on. consumed=0 gives torch.utils.data.DistributedSampler's indices for the same arguments.
    `order`: the epoch's global order, a permutation of range(dataset_len), if not epoch_order's (shuffle, seed
    and epoch are then not read): ddpkit.data.length_sampler's, which groups samples of similar length.
    """
    dataset_len, num_replicas, rank = (_as_int(dataset_len, "dataset length"), _as_int(num_replicas, "num_replicas"),
                                       _as_int(rank, "rank"))
    consumed, seed, epoch = _as_int(consumed, "consumed"), _as_int(seed, "seed"), _as_int(epoch, "epoch")
    _check(dataset_len, num_replicas, rank, drop_last, consumed)
    end = consumed + remaining_positions(dataset_len, num_replicas, consumed, drop_last)
    if consumed + rank >= end:  # nothing left of this epoch
        return []
    positions = torch.arange(consumed + rank, end, num_replicas)
    if order is None:
        order = epoch_order(dataset_len, shuffle, seed, epoch)
    return order[positions % dataset_len].tolist()  # positions >= N are padding: order[p % N]


class DistributedSampler(Sampler[int]):
    """Shards a map-style data set over data-parallel replicas; resumable mid-epoch onto any world size.

    num_replicas, rank: default to the process group's world size and rank, or 1 and 0 without one.
    shuffle, seed: shuffle with seed + epoch, identically on every rank; call `set_epoch` every epoch.
    drop_last: drop the tail that does not split evenly instead of padding it with repeated samples.

    `consumed` is the global number of positions of this epoch handed out so far (padding included); it
    moves by num_replicas per index this rank yields. A Trainer whose DataLoader prefetches may set it to
    what was really trained on right before `state_dict()`. When a pass ends it stays at the epoch's end
    (a checkpoint taken then resumes to an empty rest of the epoch). A new pass starts from 0, as torch's
    does, unless `consumed` was loaded (`load_state_dict`) or set since the last pass moved it.
    """

    def __init__(self, dataset: Sized, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        grouped = dist.is_available() and dist.is_initialized()
        if num_replicas is None:
            num_replicas = dist.get_world_size() if grouped else 1
        if rank is None:
            rank = dist.get_rank() if grouped else 0
        self.dataset = dataset
        self.num_replicas = _as_int(num_replicas, "num_replicas")
        self.rank = _as_int(rank, "rank")
        self.shuffle = bool(shuffle)
        self.seed = _as_int(seed, "seed")
        self.drop_last = bool(drop_last)
        _check(len(dataset), self.num_replicas, self.rank, self.drop_last)
        self.epoch = 0
        self._consumed = 0
        self._token = 0  # bumped by every new pass, set_epoch and load_state_dict: older iterators go quiet
        self._pass_start: int | None = None  # where the latest pass began, so len() holds still during it
        # Whether a pass moved `consumed` last, finished or not (a peek at the first batch, a loop that broke off):
        # then the next pass starts the epoch over, as torch's does, instead of yielding the rest or nothing. Not
        # once a Trainer set `consumed` (even to the same value) or load_state_dict loaded it: that is resumed.
        self._left_by_pass = False

    @property
    def consumed(self) -> int:
        return self._consumed

    @consumed.setter
    def consumed(self, value: int) -> None:
        self._consumed, self._left_by_pass = value, False

    def _position(self) -> int:
        return 0 if self._left_by_pass else self._consumed

    def global_order(self) -> torch.Tensor:
        """The current epoch's order of sample indices over all ranks (before padding): a subclass may draw
        another, as long as every rank draws the same and it depends on no world size (a resume onto another
        one continues it)."""
        return epoch_order(len(self.dataset), self.shuffle, self.seed, self.epoch)

    def __iter__(self) -> Iterator[int]:
        start = self._position()
        indices = shard_indices(len(self.dataset), self.num_replicas, self.rank, self.shuffle, self.seed,
                                self.epoch, start, self.drop_last, order=self.global_order())
        self._token += 1
        self.consumed, self._pass_start = start, start
        return self._hand_out(indices, start, self._token)

    def _hand_out(self, indices: list[int], start: int, token: int) -> Iterator[int]:
        # consumed advances before each yield: a BatchSampler pulls a whole batch before it is trained on.
        for i, index in enumerate(indices):
            if token == self._token:
                self._consumed = start + (i + 1) * self.num_replicas  # every rank took its (i+1)-th index
                self._left_by_pass = True
            yield index
        if not indices and token == self._token:  # an empty rest of the epoch (resumed at its end) is a pass too
            self._left_by_pass = True

    def __len__(self) -> int:
        """Indices this rank yields in the current pass (the running one, else the next), resumed or not."""
        start = self._pass_start if self._pass_start is not None else self._position()
        left = remaining_positions(len(self.dataset), self.num_replicas, start, self.drop_last)
        return left // self.num_replicas  # every rank gets the same share of a multiple of R positions

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for `epoch`. The same epoch as now keeps the position (e.g. one just loaded)."""
        epoch = _as_int(epoch, "epoch")
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0
        self._token += 1  # iterators of an earlier pass no longer move `consumed`
        self._pass_start = None

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "seed": self.seed, "consumed": _as_int(self.consumed, "consumed")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at global position state["consumed"] of state["epoch"], on this sampler's world size."""
        missing = {"epoch", "seed", "consumed"} - set(state)
        if missing:
            raise KeyError(f"sampler state lacks {', '.join(sorted(missing))}; expected the dict from state_dict()")
        seed, epoch, consumed = (_as_int(state["seed"], "seed"), _as_int(state["epoch"], "epoch"),
                                 _as_int(state["consumed"], "consumed"))
        if seed != self.seed:
            raise ValueError(f"the checkpoint's sampler used seed={seed} but this sampler has seed={self.seed}; "
                             f"the epoch's order would differ. Construct the sampler with seed={seed} (ddpkit's "
                             f"Trainer seeds it with --data_seed, or --seed where that is unset: pass {seed})")
        if consumed < 0:
            raise ValueError(f"consumed must be >= 0, the checkpoint says {consumed}")
        self._load_order(state)
        self.epoch, self.consumed = epoch, consumed
        self._token += 1
        self._pass_start = None  # a loaded position is resumed, even the epoch's end (consumed was set above)

    def _load_order(self, state: dict[str, Any]) -> None:
        """Check (or adopt) what a saved order depends on beyond seed and epoch: nothing, here. A length-grouped
        sampler's state is refused while its epoch is under way (its rest is in another order)."""
        if "group_size" in state and 0 < state["consumed"] < len(self.dataset):
            raise ValueError("this sampler state is a length-grouped sampler's (train_sampling_strategy="
                             "'group_by_length'), and its epoch is under way: the rest of it is in another order than "
                             "this sampler's. Resume with that strategy (ddpkit.LengthGroupedSampler); switch at an "
                             "epoch's end")
