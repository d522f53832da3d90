"""DistributedSampler: torch's layout at position 0, and exact mid-epoch resume onto any world size.

    python -m pytest -q tests/data/test_sampler.py

Pure unit tests: a "world" of R ranks is R sampler objects advanced in lockstep, as real ranks are.
"""

from __future__ import annotations

import collections
import itertools

import pytest
import torch
import torch.utils.data
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ddpkit.data.sampler import DistributedSampler, remaining_positions, shard_indices

FAST = settings(max_examples=60, deadline=None)

lengths = st.integers(min_value=0, max_value=120)
worlds = st.integers(min_value=1, max_value=9)
seeds = st.integers(min_value=-1000, max_value=2**31)
epochs = st.integers(min_value=0, max_value=1000)


def world(n: int, replicas: int, **kwargs) -> list[DistributedSampler]:
    return [DistributedSampler(range(n), num_replicas=replicas, rank=r, **kwargs) for r in range(replicas)]


def order_of(n: int, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """The epoch's global order as a world of one sees it (no padding is ever needed for R = 1)."""
    return shard_indices(n, 1, 0, shuffle=shuffle, seed=seed, epoch=epoch)


# -- torch compatibility ----------------------------------------------------------------------------------------

@FAST
@given(n=lengths, replicas=worlds, data=st.data(), shuffle=st.booleans(), seed=seeds, epoch=epochs,
       drop_last=st.booleans())
def test_same_indices_and_length_as_torch(n, replicas, data, shuffle, seed, epoch, drop_last):
    assume(not (drop_last and 0 < n < replicas))  # refused with a ValueError (torch gives an empty shard)
    rank = data.draw(st.integers(0, replicas - 1), label="rank")
    theirs = torch.utils.data.DistributedSampler(range(n), num_replicas=replicas, rank=rank, shuffle=shuffle,
                                                 seed=seed, drop_last=drop_last)
    ours = DistributedSampler(range(n), num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed,
                              drop_last=drop_last)
    theirs.set_epoch(epoch)
    ours.set_epoch(epoch)
    assert list(ours) == list(theirs)
    assert len(ours) == len(theirs)
    assert shard_indices(n, replicas, rank, shuffle, seed, epoch, 0, drop_last) == list(theirs)


def test_padding_longer_than_the_data_set_repeats_cyclically_like_torch():
    for n, replicas in [(1, 7), (2, 9), (3, 8)]:
        for rank in range(replicas):
            theirs = torch.utils.data.DistributedSampler(range(n), num_replicas=replicas, rank=rank, seed=5)
            assert shard_indices(n, replicas, rank, seed=5) == list(theirs)


# -- one epoch's shards -----------------------------------------------------------------------------------------

@FAST
@given(n=lengths, replicas=worlds, shuffle=st.booleans(), seed=seeds, epoch=epochs, consumed=st.integers(0, 130))
def test_shards_split_the_rest_of_the_order_evenly_with_padding_only_from_its_start(
        n, replicas, shuffle, seed, epoch, consumed):
    order = order_of(n, shuffle, seed, epoch)
    shards = [shard_indices(n, replicas, r, shuffle, seed, epoch, consumed) for r in range(replicas)]
    rest = order[consumed:]
    assert len({len(s) for s in shards}) == 1  # equal lengths: no rank waits in a collective for another
    assert len(shards[0]) == -(-len(rest) // replicas)
    # Interleaving the shards back (rank r holds positions r, r+R, ...) gives the rest, then the padding.
    merged = [s[i] for i in range(len(shards[0])) for s in shards]
    assert merged[:len(rest)] == rest
    padding = merged[len(rest):]
    assert len(padding) < replicas
    assert padding == [order[i % n] for i in range(len(padding))]


@FAST
@given(n=lengths, replicas=worlds, shuffle=st.booleans(), seed=seeds, epoch=epochs)
def test_shards_are_disjoint_and_cover_the_data_set(n, replicas, shuffle, seed, epoch):
    shards = [list(s) for s in world(n, replicas, shuffle=shuffle, seed=seed)]
    seen = collections.Counter(itertools.chain.from_iterable(shards))
    assert set(seen) == set(range(n))
    # Only the padding repeats, and there is less of it than one sample per rank.
    assert sum(seen.values()) - n == len(shards[0]) * replicas - n < replicas


@FAST
@given(n=st.integers(1, 120), replicas=worlds, shuffle=st.booleans(), seed=seeds, epoch=epochs,
       consumed=st.integers(0, 130))
def test_drop_last_drops_the_uneven_tail_and_never_repeats(n, replicas, shuffle, seed, epoch, consumed):
    assume(n >= replicas)
    order = order_of(n, shuffle, seed, epoch)
    shards = [shard_indices(n, replicas, r, shuffle, seed, epoch, consumed, drop_last=True) for r in range(replicas)]
    rest = order[consumed:]
    kept = len(rest) // replicas * replicas
    assert all(len(s) == kept // replicas for s in shards)
    merged = [s[i] for i in range(kept // replicas) for s in shards]
    assert merged == rest[:kept]  # the last len(rest) % R samples of the order are the ones dropped


@FAST
@given(n=st.integers(20, 120), replicas=worlds, seed=seeds, epoch=epochs)
def test_same_seed_and_epoch_same_order_another_epoch_another(n, replicas, seed, epoch):
    a, b = world(n, replicas, seed=seed), world(n, replicas, seed=seed)
    for s in a + b:
        s.set_epoch(epoch)
    assert [list(s) for s in a] == [list(s) for s in b]
    before = [list(s) for s in a]
    for s in a:
        s.set_epoch(epoch + 1)
    after = [list(s) for s in a]
    assert after != before  # 20! orders: a collision would be a bug, not luck
    assert set(itertools.chain(*after)) == set(itertools.chain(*before)) == set(range(n))


def test_without_shuffle_the_order_is_the_data_set_order_in_every_epoch():
    sampler = DistributedSampler(range(10), num_replicas=3, rank=1, shuffle=False)
    assert list(sampler) == [1, 4, 7, 0]  # positions 1, 4, 7, 10; position 10 is padding: order[0]
    sampler.set_epoch(3)
    assert list(sampler) == [1, 4, 7, 0]


# -- resume -----------------------------------------------------------------------------------------------------

def take(iterators, count):
    """Every rank of a world pulls `count` indices (a batch boundary when count is a multiple of the batch)."""
    return [list(itertools.islice(it, count)) for it in iterators]


def common_state(samplers):
    states = [s.state_dict() for s in samplers]
    assert all(state == states[0] for state in states)  # ranks move in lockstep, so any rank's state will do
    return states[0]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 60), old=worlds, new=worlds, batch=st.integers(1, 5), shuffle=st.booleans(),
       seed=seeds, epoch=epochs, drop_last=st.booleans())
def test_resume_at_every_batch_boundary_on_any_world_size(n, old, new, batch, shuffle, seed, epoch, drop_last):
    assume(not drop_last or n >= max(old, new))
    kwargs = {"shuffle": shuffle, "seed": seed, "drop_last": drop_last}
    whole = []
    for s in world(n, old, **kwargs):
        s.set_epoch(epoch)
        whole.append(list(s))
    per_rank = len(whole[0])
    for stop in range(0, per_rank + batch, batch):  # every batch boundary, the end of the epoch included
        first = world(n, old, **kwargs)
        for s in first:
            s.set_epoch(epoch)
        before = take([iter(s) for s in first], stop)
        state = common_state(first)
        assert state == {"epoch": epoch, "seed": seed, "consumed": min(stop, per_rank) * old}

        second = world(n, new, **kwargs)
        for s in second:
            s.load_state_dict(state)
            s.set_epoch(epoch)  # what a training loop does next; the same epoch keeps the position
        after = [list(s) for s in second]
        assert all(len(a) == len(s) for a, s in zip(after, second))
        assert len({len(a) for a in after}) == 1

        seen = collections.Counter(itertools.chain(*before, *after))
        extra = sum(seen.values()) - n
        if drop_last:
            assert max(seen.values(), default=1) == 1  # nothing seen twice
            assert -extra < max(old, new)  # only an uneven tail is dropped
        else:
            assert set(seen) == set(range(n))  # nothing skipped
            assert 0 <= extra < max(old, new)  # only padding repeats
        if new == old:
            assert [b + a for b, a in zip(before, after)] == whole  # the exact tail of the uninterrupted run


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 60), hops=st.lists(st.tuples(worlds, st.integers(0, 12)), min_size=1, max_size=4),
       last=worlds, seed=seeds, epoch=epochs)
def test_many_interruptions_on_changing_world_sizes_see_every_sample_once(n, hops, last, seed, epoch):
    state = {"epoch": epoch, "seed": seed, "consumed": 0}
    seen = collections.Counter()
    for replicas, steps in [*hops, (last, None)]:
        samplers = world(n, replicas, seed=seed)
        for s in samplers:
            s.load_state_dict(state)
        iterators = [iter(s) for s in samplers]
        got = take(iterators, steps) if steps is not None else [list(it) for it in iterators]
        seen.update(itertools.chain(*got))
        state = common_state(samplers)
    assert set(seen) == set(range(n))
    assert sum(seen.values()) - n < max(r for r, _ in [*hops, (last, 0)])


def test_state_is_the_position_handed_out_through_a_dataloader():
    samplers = world(23, 3, seed=1)
    loaders = [torch.utils.data.DataLoader(range(23), batch_size=2, sampler=s) for s in samplers]
    batches = [iter(loader) for loader in loaders]
    for _ in range(3):
        for b in batches:
            next(b)
    assert common_state(samplers)["consumed"] == 3 * 2 * 3  # steps * per-rank batch * replicas


@FAST
@given(n=st.integers(1, 80), replicas=worlds, seed=seeds, epoch=epochs, pulled=st.integers(0, 90))
def test_state_dict_round_trip(n, replicas, seed, epoch, pulled):
    a = DistributedSampler(range(n), num_replicas=replicas, rank=0, seed=seed)
    a.set_epoch(epoch)
    it = iter(a)
    list(itertools.islice(it, pulled))
    state = a.state_dict()
    assert set(state) == {"epoch", "seed", "consumed"} and all(type(v) is int for v in state.values())
    b = DistributedSampler(range(n), num_replicas=replicas, rank=0, seed=seed)
    b.load_state_dict(state)
    assert b.state_dict() == state
    assert len(b) == len(list(itertools.islice(iter(b), 10**6)))
    b.load_state_dict(state)
    assert list(b) == list(it)  # the loaded sampler continues as the original would have


def test_a_finished_pass_resumes_to_nothing_but_starts_over_in_process():
    sampler = DistributedSampler(range(10), num_replicas=3, rank=0, seed=2)
    full = list(sampler)
    assert sampler.consumed == 12  # the epoch's end, padding included: a checkpoint now skips nothing ...
    resumed = DistributedSampler(range(10), num_replicas=3, rank=0, seed=2)
    resumed.load_state_dict(sampler.state_dict())
    assert len(resumed) == 0 and list(resumed) == []  # ... and replays nothing
    assert list(sampler) == full  # iterating again without set_epoch repeats the epoch, as torch's does
    sampler.set_epoch(0)
    assert list(sampler) == full
    assert list(resumed) == full  # its empty pass finished the epoch, so the next pass starts over too


@FAST
@given(n=st.integers(1, 40), replicas=worlds, seed=seeds, pulled=st.integers(0, 45), batch=st.integers(1, 5))
def test_a_pass_broken_off_is_followed_by_a_whole_pass_as_in_torch(n, replicas, seed, pulled, batch):
    """A peek at the first batch or a loop that breaks off, then a new pass: the whole epoch again, as torch's."""
    ours = DistributedSampler(range(n), num_replicas=replicas, rank=replicas - 1, seed=seed)
    theirs = torch.utils.data.DistributedSampler(range(n), num_replicas=replicas, rank=replicas - 1, seed=seed)
    for sampler in (ours, theirs):
        list(itertools.islice(iter(sampler), pulled))
    assert len(ours) == len(theirs) and list(ours) == list(theirs)
    loaders = [torch.utils.data.DataLoader(range(n), batch_size=batch, sampler=s) for s in (ours, theirs)]
    for loader in loaders:
        next(iter(loader), None)
    assert [len(loader) for loader in loaders] == [len(loaders[1])] * 2
    assert [b.tolist() for b in loaders[0]] == [b.tolist() for b in loaders[1]]


def test_a_full_last_batch_and_a_partial_one_leave_the_same_state():
    # A BatchSampler stops pulling after a full last batch but pulls past the end after a partial one.
    for batch in (4, 3):
        sampler = DistributedSampler(range(16), num_replicas=2, rank=0, seed=0)
        list(torch.utils.data.BatchSampler(sampler, batch_size=batch, drop_last=False))
        assert sampler.state_dict()["consumed"] == 16


def test_set_epoch_resets_position_only_for_another_epoch():
    sampler = DistributedSampler(range(30), num_replicas=2, rank=1)
    sampler.load_state_dict({"epoch": 4, "seed": 0, "consumed": 10})
    sampler.set_epoch(4)
    assert sampler.consumed == 10 and len(sampler) == 10
    sampler.set_epoch(5)
    assert sampler.consumed == 0 and len(sampler) == 15


def test_len_holds_still_during_a_pass_and_a_trainer_may_set_consumed():
    sampler = DistributedSampler(range(20), num_replicas=2, rank=0)
    it = iter(sampler)
    for _ in range(4):
        next(it)
        assert len(sampler) == 10
    assert sampler.consumed == 8
    sampler.consumed = 6  # the Trainer knows a prefetched batch was not trained on
    assert sampler.state_dict()["consumed"] == 6
    sampler.load_state_dict(sampler.state_dict())
    assert len(sampler) == 7 and list(sampler) == shard_indices(20, 2, 0, consumed=6)
    # Set to where the last pass stopped (nothing prefetched): still a position to continue from, not a restart.
    fresh = DistributedSampler(range(20), num_replicas=2, rank=0)
    taken = list(itertools.islice(iter(fresh), 4))
    fresh.consumed = fresh.consumed  # what was trained: the same value the pass left
    assert list(fresh) == shard_indices(20, 2, 0, consumed=8) and len(taken) == 4


def test_an_iterator_of_an_earlier_epoch_no_longer_moves_the_position():
    sampler = DistributedSampler(range(20), num_replicas=2, rank=0)
    stale = iter(sampler)
    next(stale)
    sampler.set_epoch(1)
    list(stale)
    assert sampler.state_dict() == {"epoch": 1, "seed": 0, "consumed": 0}


def test_remaining_positions_is_a_multiple_of_the_world():
    assert remaining_positions(10, 4) == 12 and remaining_positions(10, 4, drop_last=True) == 8
    assert remaining_positions(10, 4, consumed=8) == 4 and remaining_positions(10, 4, consumed=12) == 0


# -- defaults and validation ------------------------------------------------------------------------------------

def test_world_defaults_to_one_process_without_a_process_group():
    sampler = DistributedSampler(range(5))
    assert (sampler.num_replicas, sampler.rank) == (1, 0)


def test_world_defaults_to_the_process_group(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 2)
    sampler = DistributedSampler(range(10), shuffle=False)
    assert (sampler.num_replicas, sampler.rank) == (4, 2)
    assert list(sampler) == [2, 6, 0]


@pytest.mark.parametrize("replicas, rank", [(4, 4), (4, -1), (1, 1)])
def test_rank_outside_the_world_is_refused(replicas, rank):
    with pytest.raises(ValueError, match=r"rank .* is outside \[0, "):
        DistributedSampler(range(10), num_replicas=replicas, rank=rank)
    with pytest.raises(ValueError, match="outside"):
        shard_indices(10, replicas, rank)


@pytest.mark.parametrize("replicas", [0, -2])
def test_fewer_than_one_replica_is_refused(replicas):
    with pytest.raises(ValueError, match="num_replicas must be >= 1"):
        DistributedSampler(range(10), num_replicas=replicas, rank=0)


def test_drop_last_on_a_data_set_smaller_than_the_world_says_how_to_fix_it():
    with pytest.raises(ValueError, match=r"empty shard.*drop_last=False.*at most 3 replicas"):
        DistributedSampler(range(3), num_replicas=4, rank=0, drop_last=True)
    DistributedSampler(range(3), num_replicas=4, rank=3, drop_last=False)  # padded instead: fine


def test_non_integer_arguments_are_refused():
    with pytest.raises(TypeError, match="num_replicas must be an integer"):
        DistributedSampler(range(10), num_replicas=2.0, rank=0)
    with pytest.raises(TypeError, match="epoch must be an integer"):
        DistributedSampler(range(10), num_replicas=2, rank=0).set_epoch(1.5)


def test_state_from_another_seed_is_refused():
    sampler = DistributedSampler(range(10), num_replicas=2, rank=0, seed=1)
    with pytest.raises(ValueError, match="seed=7.*seed=1.*seed=7"):
        sampler.load_state_dict({"epoch": 0, "seed": 7, "consumed": 0})


def test_incomplete_or_negative_state_is_refused():
    sampler = DistributedSampler(range(10), num_replicas=2, rank=0)
    with pytest.raises(KeyError, match="consumed"):
        sampler.load_state_dict({"epoch": 0, "seed": 0})
    with pytest.raises(ValueError, match="consumed must be >= 0"):
        sampler.load_state_dict({"epoch": 0, "seed": 0, "consumed": -2})
    sampler.consumed = -1
    with pytest.raises(ValueError, match="consumed must be >= 0"):
        iter(sampler)
    with pytest.raises(ValueError, match="consumed must be >= 0"):
        len(sampler)
