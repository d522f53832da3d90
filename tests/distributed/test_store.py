"""The rendezvous' own checks (ddpkit.distributed.store), in one process on an in-memory store; its runs under the launchers
are test_launch's and test_env's."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from ddpkit.distributed import store as meet
from ddpkit.distributed.env import LaunchInfo
from ddpkit.errors import LaunchError


def test_each_making_of_the_group_has_its_own_prefix_and_a_count_mismatch_is_named():
    store = dist.HashStore()
    ranks = [LaunchInfo(rank=r, world_size=2, launcher="torchrun") for r in range(2)]
    first = [meet._fresh_prefix(store, info) for info in ranks]  # the first group: both under prefix 1
    first[0].set("gloo address", "old")
    again = meet._fresh_prefix(store, ranks[0])  # made again: what the first group left is not seen
    assert first[1].get("gloo address") == b"old" and not again.check(["gloo address"])
    # Rank 0 made the group twice, rank 1 once: they join under different names; the timeout says why.
    first[1].add("ddpkit/joined", 1)
    with pytest.raises(LaunchError, match=r"different numbers of times \(\{0: 2, 1: 1\}"):
        meet._wait_for_everyone(again, ranks[0], datetime.timedelta(seconds=0.2), store)
    # A rank that never came at all is the plain message.
    other = dist.HashStore()
    alone = meet._fresh_prefix(other, ranks[0])
    with pytest.raises(LaunchError, match="only 1 of the 2 processes"):
        meet._wait_for_everyone(alone, ranks[0], datetime.timedelta(seconds=0.2), other)


def test_an_ipv6_master_address_meets_under_mpi_and_slurm():
    """MASTER_ADDR=::1 made tcp://::1:port, whose port torch could not read ("Port could not be cast")."""
    import socket

    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
        sock.bind(("::1", 0))
        port = sock.getsockname()[1]
    info = LaunchInfo(rank=0, world_size=1, launcher="mpi", master_addr="::1", master_port=port)
    store = meet.rendezvous(info, datetime.timedelta(seconds=20))
    store.set("k", "v")
    assert store.get("k") == b"v"
