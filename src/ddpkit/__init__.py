"""ddpkit: data-parallel training for PyTorch.

    world = ddpkit.init_process_group()                 # from torchrun / ddpkit launch / SLURM, or a world of one
    model = ddpkit.DistributedDataParallel(model)
    sampler = ddpkit.DistributedSampler(dataset)
"""

from .comm import Comm, barrier, destroy_process_group, init_process_group, main_process_first
from .ddp import DistributedDataParallel, ReplicaDivergenceError
from .monitor import PeerFailedError, StallError
from .sampler import DistributedSampler
from .env import (
    DistEnv,
    LaunchError,
    LaunchInfo,
    available_backends,
    read_launch_env,
)

__version__ = "0.1.0"

__all__ = [
    "Comm",
    "DistEnv",
    "DistributedDataParallel",
    "DistributedSampler",
    "LaunchError",
    "LaunchInfo",
    "available_backends",
    "barrier",
    "destroy_process_group",
    "init_process_group",
    "main_process_first",
    "read_launch_env",
    "StallError",
    "ReplicaDivergenceError",
    "PeerFailedError",
]
