"""A DistributedSampler that puts samples of similar length in the same global batch (Transformers'
train_sampling_strategy="group_by_length"): less padding per batch, the same samples once per epoch.

    lengths = ddpkit.data.length_sampler.dataset_lengths(dataset)      # len(sample["input_ids"]), or a "length" column
    sampler = ddpkit.LengthGroupedSampler(dataset, lengths, group_size=per_device_batch * accumulation, seed=0)

The epoch's global order: the samples shuffled with seed + epoch, cut into runs of `group_size` times up to 50
samples, each run sorted by length, longest first, and the longest sample of all moved to the very front (an
out-of-memory error then comes at the first step, not hours in). Ranks take that order interleaved, as from
ddpkit.DistributedSampler (rank r the positions r, r + R, ...), so the R batches of one step come from the same
stretch of a sorted run: similar lengths on every rank, and the ranks of a step wait less for each other too.
The order depends on no world size, so a run resumes mid-epoch onto another one exactly, as DistributedSampler's
does; group_size travels in the sampler state, and a resume adopts it for the rest of that epoch, so a changed
batch size cannot reshuffle a started epoch (the next is grouped by the new size). With a generator seeded so,
the order is the one Transformers' get_length_grouped_indices draws; lengths may be fractional (seconds of audio).
Evaluation is not grouped (Transformers groups its evaluation sampler too): ddpkit's evaluation deals batches in
dataset order, so its predictions come back in dataset order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Sized
from typing import Any

import torch

from ddpkit.data.sampler import DistributedSampler, _as_int

RUNS_OF_GROUPS = 50  # a sorted run holds at most this many groups (and at least one; a quarter of the data else)


def length_grouped_order(lengths: Sequence[int], group_size: int, seed: int = 0, epoch: int = 0) -> torch.Tensor:
    """The epoch's order of range(len(lengths)), grouped by length (module docstring); the same on every rank."""
    count = len(lengths)
    shuffled = torch.randperm(count, generator=torch.Generator().manual_seed(seed + epoch))
    if count == 0:
        return shuffled
    run = group_size * max(1, min(count // (group_size * 4), RUNS_OF_GROUPS))
    length = torch.as_tensor([float(n) for n in lengths], dtype=torch.float64)  # seconds of audio, say: not rounded
    order = torch.cat([piece[torch.sort(length[piece], descending=True, stable=True).indices]
                       for piece in shuffled.split(run)])
    heads = torch.arange(0, count, run)  # each run's longest sample
    longest = int(heads[torch.argmax(length[order[heads]])])
    order[[0, longest]] = order[[longest, 0]]
    return order


def dataset_lengths(dataset: Any, column: str = "length", input_name: str = "input_ids") -> list[int]:
    """Each sample's length: the dataset's `column` where it has one (a datasets.Dataset with precomputed
    lengths), else len(sample[input_name]) of every sample, as Transformers measures them."""
    names = getattr(dataset, "column_names", None)
    if names is not None and column in names:
        return list(dataset[column])
    lengths = []
    for index in range(len(dataset)):
        sample = dataset[index]
        measurable = isinstance(sample, Mapping) and input_name in sample
        try:
            lengths.append(len(sample[input_name]) if measurable else None)
        except TypeError:  # a number, a 0-d tensor: no length
            measurable = False
        if not measurable:
            what = f"a dict with keys {sorted(sample)}" if isinstance(sample, Mapping) else type(sample).__name__
            lacks = f"whose {input_name!r} has no length" if isinstance(sample, Mapping) and input_name in sample \
                else f"without {input_name!r}"
            raise ValueError(f"train_sampling_strategy='group_by_length' needs each sample's length, and sample "
                             f"{index} is {what}, {lacks} to measure: give the dataset a {column!r} column of "
                             f"lengths (length_column_name names it), or samples that are dicts with {input_name!r} "
                             "(the processing class's first model input) holding a sequence")
    return lengths


class LengthGroupedSampler(DistributedSampler):
    """ddpkit.DistributedSampler (resumable onto any world size, padding and drop_last alike) in the length-grouped
    order of the module docstring. lengths: one per sample; group_size: the samples one rank takes per optimizer
    step (per-device batch size times gradient accumulation steps), the grain of the sorted runs."""

    def __init__(self, dataset: Sized, lengths: Sequence[int], group_size: int, num_replicas: int | None = None,
                 rank: int | None = None, seed: int = 0, drop_last: bool = False) -> None:
        if len(lengths) != len(dataset):
            raise ValueError(f"{len(lengths)} lengths for a dataset of {len(dataset)} samples: give one per sample")
        super().__init__(dataset, num_replicas, rank, shuffle=True, seed=seed, drop_last=drop_last)
        self.lengths = list(lengths)
        self.own_group_size = self.group_size = _group_size(group_size)

    def global_order(self) -> torch.Tensor:
        return length_grouped_order(self.lengths, self.group_size, self.seed, self.epoch)

    def set_epoch(self, epoch: int) -> None:
        """DistributedSampler's; a new epoch is grouped by this sampler's own group size again (a resumed one kept
        the saved size until it ended)."""
        if epoch != self.epoch:
            self.group_size = self.own_group_size
        super().set_epoch(epoch)

    def state_dict(self) -> dict[str, int]:
        return {**super().state_dict(), "group_size": self.group_size}

    def _load_order(self, state: dict[str, Any]) -> None:
        if "group_size" in state:
            self.group_size = _group_size(state["group_size"])  # the saved order for the rest of its epoch
        elif 0 < state["consumed"] < len(self.dataset):
            raise ValueError("this sampler state is not a length-grouped sampler's (train_sampling_strategy random or "
                             "sequential), and its epoch is under way: the rest of it is in another order. Resume "
                             "with the strategy it was saved with; switch at an epoch's end")


def _group_size(value: Any) -> int:
    value = _as_int(value, "group_size")
    if value < 1:
        raise ValueError(f"group_size must be >= 1 (the samples a rank takes per step), got {value}")
    return value


__all__ = ["LengthGroupedSampler", "dataset_lengths", "length_grouped_order"]
