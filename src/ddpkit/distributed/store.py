"""Meeting the other processes of the world through torch's rendezvous (a TCPStore), with a check that all came.

    store = rendezvous(info, join_timeout)     # info: what the launcher said (ddpkit.distributed.env.LaunchInfo)

A port already in use and a WORLD_SIZE that does not match the processes started fail at once with a message that
says what to do, instead of a bare timeout.
"""

from __future__ import annotations

import datetime
import time
from typing import TYPE_CHECKING

import torch.distributed as dist

from ddpkit.errors import LaunchError

if TYPE_CHECKING:
    from ddpkit.distributed.env import LaunchInfo


def rendezvous(info: LaunchInfo, join_timeout: datetime.timedelta) -> dist.Store:
    """Meet the other processes through torch's rendezvous (TCPStore) and check that all of them came."""
    if info.bad_master_port is not None:
        # torch's env:// would say "invalid literal for int()" or "port must have value from 0 to 65535", without
        # the variable's name; a ValueError too, as torch's.
        raise ValueError(f"MASTER_PORT={info.bad_master_port!r} is not a port number (a whole number from 0 to "
                         f"65535), and this process (rank {info.rank} of {info.world_size}, {info.launcher} "
                         "environment) meets the world on it: export the same free port of rank 0's host to every "
                         "process (e.g. MASTER_PORT=29500), or leave it to the launcher (ddpkit launch and torchrun "
                         "set it)")
    if info.launcher == "torchrun":
        # env:// reads MASTER_ADDR/PORT itself; under TORCHELASTIC_USE_AGENT_STORE it connects to the agent's
        # store as a client and never binds the port, which the agent already holds.
        if not info.agent_store and (info.master_addr is None or info.master_port is None):
            raise LaunchError("RANK and WORLD_SIZE are set but MASTER_ADDR/MASTER_PORT are not; "
                              "set both, or start the job with ddpkit launch or torchrun")
        url = "env://"
    else:
        if info.master_addr is None or info.master_port is None:
            raise LaunchError(f"the {info.launcher} environment gives rank {info.rank} of {info.world_size} but no "
                              "MASTER_ADDR/MASTER_PORT; export both to the address and a free port of rank 0's host")
        host = info.master_addr
        if ":" in host and not host.startswith("["):  # an IPv6 address: tcp://[::1]:29500, as env:// takes it bare
            host = f"[{host}]"
        url = f"tcp://{host}:{info.master_port}"
    where = f"{info.master_addr}:{info.master_port}"
    try:
        store, _, _ = next(dist.rendezvous(url, rank=info.rank, world_size=info.world_size, timeout=join_timeout))
    except (RuntimeError, ValueError) as exc:  # DistNetworkError and DistStoreError are RuntimeErrors
        text = str(exc)
        if "address already in use" in text.lower() or "EADDRINUSE" in text:
            raise LaunchError(f"MASTER_PORT {info.master_port} is already in use on {info.master_addr}: another "
                              "job or a stale process holds it. Pick a free port (MASTER_PORT, --master-port), "
                              "or let ddpkit launch choose one") from exc
        if "waiting for clients" in text or "timed out" in text.lower():
            raise LaunchError(f"not every process of the world arrived at {where} within "
                              f"{join_timeout.total_seconds():g} s ({text.strip()}). WORLD_SIZE is "
                              f"{info.world_size}: start exactly that many processes (ddpkit launch "
                              "--nproc-per-node N), or check that every node can reach MASTER_ADDR") from exc
        raise
    mine = _fresh_prefix(store, info)
    _wait_for_everyone(mine, info, join_timeout, store)
    return mine


def _fresh_prefix(store: dist.Store, info: LaunchInfo) -> dist.Store:
    """The agent's store outlives the process group: the keys an earlier group left in it (gloo's peer
    addresses, our join count) must not be read by the next one. That earlier group may be a failed attempt's
    (the restarted workers) or this process's own, destroyed and made again (a sweep of several runs in one
    script): both get their own prefix. Without it the second group's gloo read the first one's addresses;
    under torchrun a loop of init and destroy timed out in its third round, and torch's own init in its
    second (test_launch). Each rank counts its own makings in the store: every rank makes the group as many
    times as the others (no group forms otherwise), so the counts agree; where they do not (a rank retried a
    failed init), the join's timeout names the counts."""
    made = store.add(_made_key(info, info.rank), 1)
    return dist.PrefixStore(f"ddpkit/attempt_{info.restart}/{made}/", store)


def _made_key(info: LaunchInfo, rank: int) -> str:
    return f"ddpkit/attempt_{info.restart}/made/{rank}"


def _wait_for_everyone(store: dist.Store, info: LaunchInfo, join_timeout: datetime.timedelta,
                       shared: dist.Store) -> None:
    """Every process counts itself in (under this group's own prefix, `shared` being the store without it); too
    few within the join timeout is a launch error. (A rank >= WORLD_SIZE is caught when the environment is
    read.)"""
    key = "ddpkit/joined"
    arrived = store.add(key, 1)
    deadline = time.monotonic() + join_timeout.total_seconds()
    while arrived < info.world_size and time.monotonic() < deadline:
        time.sleep(0.05)
        arrived = store.add(key, 0)
    if arrived < info.world_size:
        made = {rank: shared.add(_made_key(info, rank), 0) for rank in range(info.world_size)}
        if len({count for count in made.values() if count}) > 1:
            raise LaunchError(f"the ranks made the process group different numbers of times ({made}: rank: "
                              "times), so they wait for each other under different names. Every rank must make "
                              "and destroy it alike; a rank whose init failed and was retried counts twice")
        raise LaunchError(f"only {arrived} of the {info.world_size} processes that WORLD_SIZE announces joined "
                          f"within {join_timeout.total_seconds():g} s. Start exactly WORLD_SIZE processes "
                          "(ddpkit launch --nproc-per-node N sets it for you), or fix WORLD_SIZE; if they were "
                          "started, one failed or hangs before init_process_group (see its output)")


__all__ = ["LaunchError", "rendezvous"]
