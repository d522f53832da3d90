"""Joining and leaving the world: the process group from the launcher's environment (ddpkit.distributed.env),
with the stall inspector (ddpkit.doctor) watching its collectives.

    world = ddpkit.init_process_group()     # from ddpkit launch / torchrun / SLURM / MPI; else a world of one
    ...
    ddpkit.destroy_process_group()

This is the one module that composes the two: `Comm` (ddpkit.distributed.comm) knows only a list of observers,
and the inspector is one of them, attached here.
"""

from __future__ import annotations

import torch.distributed as dist

from ddpkit.distributed import env
from ddpkit.distributed.comm import Comm
from ddpkit.distributed.env import DistEnv
from ddpkit.doctor.inspector import attach_stall_monitor


def init_process_group(backend: str | None = None, timeout: float | None = None, device_type: str | None = None,
                       join_timeout: float | None = None, stall_seconds: float | None = None) -> DistEnv:
    """Join the launcher's world (see `ddpkit.distributed.env.init_process_group`) and start the stall inspector.

    stall_seconds: a collective waiting longer than this is explained (who never arrived, and where), and
    again at each doubling of the wait; default: a fifth of the timeout, at most 60 s; 0 turns the inspector
    off (and with it the early end of certain deadlocks, see ddpkit.doctor.inspector).
    """
    world = env.init_process_group(backend, timeout, device_type, join_timeout=join_timeout)
    if world.world_size > 1 and stall_seconds != 0:
        attach_stall_monitor(Comm.for_group(None), world.timeout.total_seconds(), stall_seconds, world.restart)
    return world


def destroy_process_group() -> None:
    """Close the observers (the stall inspector) and leave the world; a no-op without a process group."""
    if dist.is_available() and dist.is_initialized():
        Comm.for_group(None).close_observers()
    env.destroy_process_group()
    Comm.forget_groups()
