"""ddpkit.data.length_sampler: the group_by_length order (a permutation, sorted in runs, the longest sample first), a
world's ranks taking every sample once with similar lengths in each step, and an exact resume mid-epoch onto
another world size. Pure unit tests: a "world" is R sampler objects advanced in lockstep, as real ranks are."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpkit.data.length_sampler import LengthGroupedSampler, dataset_lengths, length_grouped_order
from ddpkit.data.sampler import DistributedSampler

FAST = settings(max_examples=60, deadline=None)


def _lengths(n, seed=0, top=100):
    return torch.randint(1, top, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _world(lengths, replicas, group_size, **kw):
    return [LengthGroupedSampler(range(len(lengths)), lengths, group_size, num_replicas=replicas, rank=r, **kw)
            for r in range(replicas)]


def _steps(world, batch, steps=None):
    """Each step's batches, rank by rank: [[rank 0's, rank 1's, ...], ...] (at most `steps` of them)."""
    iterators = [iter(s) for s in world]
    out = []
    while steps is None or len(out) < steps:
        step = [list(itertools.islice(it, batch)) for it in iterators]
        if not step[0]:
            return out
        out.append(step)
    return out


@FAST
@given(st.lists(st.integers(1, 50), max_size=150), st.integers(1, 9), st.integers(0, 2**31), st.integers(0, 99))
def test_the_order_is_a_permutation_sorted_in_runs_with_the_longest_sample_first(lengths, group, seed, epoch):
    order = length_grouped_order(lengths, group, seed, epoch).tolist()
    assert sorted(order) == list(range(len(lengths)))
    assert order == length_grouped_order(lengths, group, seed, epoch).tolist()  # every rank draws the same
    if not lengths:
        return
    assert lengths[order[0]] == max(lengths)
    run = group * max(1, min(len(lengths) // (group * 4), 50))
    for start in range(0, len(lengths), run):  # each run sorted, longest first, but its head (the swap's)
        tail = [lengths[i] for i in order[start + 1:start + run]]
        assert tail == sorted(tail, reverse=True), (start, tail)


@FAST
@given(st.lists(st.integers(1, 50), min_size=1, max_size=150), st.integers(1, 9), st.integers(0, 2**31))
def test_the_order_is_transformers_for_the_same_generator(lengths, group, seed):
    trainer_pt_utils = pytest.importorskip("transformers.trainer_pt_utils")
    theirs = trainer_pt_utils.get_length_grouped_indices(lengths, group, generator=torch.Generator().manual_seed(seed))
    assert length_grouped_order(lengths, group, seed, 0).tolist() == theirs


def test_fractional_lengths_are_sorted_as_they_are():
    seconds = [1.2, 1.9, 1.5, 1.1, 1.8, 1.3, 1.7, 1.4]
    order = length_grouped_order(seconds, 2, seed=0).tolist()
    assert seconds[order[0]] == 1.9 and dataset_lengths([{"input_ids": [0] * 3}]) == [3]


def test_epochs_and_seeds_draw_other_orders():
    lengths = _lengths(200)
    orders = {(seed, epoch): length_grouped_order(lengths, 4, seed, epoch).tolist()
              for seed in (0, 10) for epoch in (0, 1)}  # seed + epoch seeds it, as torch's sampler
    assert len({tuple(o) for o in orders.values()}) == 4


def test_a_world_takes_every_sample_once_and_each_step_pads_far_less_than_shuffled():
    lengths, batch = _lengths(960, seed=3), 4  # runs of 50 groups: 200 samples
    for replicas in (1, 2, 3):
        grouped = _steps(_world(lengths, replicas, batch, seed=5), batch)
        shuffled = _steps([DistributedSampler(range(960), replicas, r, seed=5) for r in range(replicas)], batch)
        taken = [i for step in grouped for part in step for i in part]
        assert sorted(taken) == list(range(960)), replicas  # 960 splits evenly: no padding, every sample once

        def padding(steps):  # what padding each batch to its longest sample adds, and to the step's longest
            own = sum(max(lengths[i] for i in part) * len(part) - sum(lengths[i] for i in part)
                      for step in steps for part in step)
            step_max = [max(lengths[i] for part in step for i in part) for step in steps]
            spread = sum(m - min(max(lengths[i] for i in part) for part in step) for m, step in zip(step_max, steps))
            return own, spread

        (pad_g, spread_g), (pad_s, spread_s) = padding(grouped), padding(shuffled)
        assert pad_g < 0.25 * pad_s, (replicas, pad_g, pad_s)
        if replicas > 1:  # the ranks of one step hold alike batches: none waits long for the others
            assert spread_g < 0.25 * spread_s, (replicas, spread_g, spread_s)
        assert max(lengths[i] for i in grouped[0][0]) == max(lengths)  # the longest first: an OOM shows at once


@pytest.mark.parametrize("before, after", [(2, 3), (3, 1), (1, 2)])
def test_a_resume_mid_epoch_onto_another_world_size_continues_the_uninterrupted_order(before, after):
    lengths, batch, epoch = _lengths(60, seed=1), 2, 1
    first = _world(lengths, before, batch, seed=9)
    for sampler in first:
        sampler.set_epoch(epoch)
    taken = [i for step in _steps(first, batch, steps=3) for part in step for i in part]
    state = first[0].state_dict()
    assert state["group_size"] == batch and state["consumed"] == len(taken) == 3 * before * batch
    # The new world was built with another batch size: the saved group size orders the rest of the epoch.
    second = _world(lengths, after, batch + 3, seed=9)
    for sampler in second:
        sampler.load_state_dict(state)
        sampler.set_epoch(epoch)
    rest = [list(s) for s in second]
    resumed = [rest[p % after][p // after] for p in range(sum(map(len, rest)))]  # interleaved back
    whole = length_grouped_order(lengths, batch, 9, epoch).tolist()
    assert resumed == whole[len(taken):] and sorted(taken + resumed) == list(range(60))
    assert second[0].group_size == batch


def test_states_of_the_other_order_are_refused_while_their_epoch_is_under_way():
    lengths = _lengths(10)
    grouped, plain = _world(lengths, 1, 2)[0], DistributedSampler(range(10), 1, 0)
    for consumed in (0, 10):  # an epoch not begun, or over: its order no longer matters
        plain.load_state_dict({**grouped.state_dict(), "consumed": consumed})
        grouped.load_state_dict({**plain.state_dict(), "consumed": consumed})
    with pytest.raises(ValueError, match="length-grouped sampler's.*under way"):
        plain.load_state_dict({**grouped.state_dict(), "consumed": 4})
    with pytest.raises(ValueError, match="not a length-grouped sampler's.*under way"):
        grouped.load_state_dict({**plain.state_dict(), "consumed": 4})


def test_a_saved_group_size_orders_the_rest_of_its_epoch_only_and_must_be_positive():
    lengths = _lengths(40)
    sampler = _world(lengths, 1, 8)[0]
    sampler.load_state_dict({"epoch": 2, "seed": 0, "consumed": 6, "group_size": 2})
    sampler.set_epoch(2)  # the resumed epoch: the saved grouping
    assert list(sampler) == length_grouped_order(lengths, 2, 0, 2).tolist()[6:]
    sampler.set_epoch(3)  # the next: this sampler's own
    assert sampler.group_size == 8 and list(sampler) == length_grouped_order(lengths, 8, 0, 3).tolist()
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        sampler.load_state_dict({"epoch": 3, "seed": 0, "consumed": 6, "group_size": 0})


class Columns:
    """A datasets.Dataset's surface that dataset_lengths reads: column_names and a column by name."""

    column_names = ["input_ids", "n"]

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, key):
        return [row[1] for row in self.rows] if key == "n" else {"input_ids": self.rows[key][0]}


def test_lengths_come_from_a_column_or_the_first_model_input_and_bad_input_is_named():
    samples = [{"input_ids": [1] * n, "text_ids": [2] * (n + 1)} for n in (3, 1, 4)]
    assert dataset_lengths(samples) == [3, 1, 4]
    assert dataset_lengths(samples, input_name="text_ids") == [4, 2, 5]
    assert dataset_lengths(Columns([([1, 2], 7), ([1], 9)]), column="n") == [7, 9]
    assert dataset_lengths(Columns([([1, 2], 7), ([1], 9)]), column="length") == [2, 1]  # no such column: measured
    with pytest.raises(ValueError, match=r"sample 1 is a dict with keys \['x'\], without 'input_ids'.*'length' column"):
        dataset_lengths([{"input_ids": [1]}, {"x": 1}])
    with pytest.raises(ValueError, match="sample 0 is tuple"):
        dataset_lengths([(1, 2)])
    with pytest.raises(ValueError, match=r"sample 0 is a dict with keys \['input_ids'\], whose 'input_ids' has no len"):
        dataset_lengths([{"input_ids": torch.tensor(3)}])
    with pytest.raises(ValueError, match="2 lengths for a dataset of 3 samples"):
        LengthGroupedSampler(range(3), [1, 2], 1, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        LengthGroupedSampler(range(2), [1, 2], 0, num_replicas=1, rank=0)
