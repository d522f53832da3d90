"""ddpkit: data-parallel training for PyTorch.

    world = ddpkit.init_process_group()                 # from torchrun / ddpkit launch / SLURM, or a world of one
    model = ddpkit.DistributedDataParallel(model)
    sampler = ddpkit.DistributedSampler(dataset)
"""

from .comm import Comm, barrier, destroy_process_group, init_process_group, main_process_first
from .ddp import DistributedDataParallel, ReplicaDivergenceError
from .errors import DeadlockError, PeerFailedError, PeerLeftError, PeerVanishedError, StallError
from .join import Join
from .sampler import DistributedSampler
from .length_sampler import LengthGroupedSampler
from .zero import ZeroRedundancyOptimizer
from .precision import AgreedGradScaler
from .args import ArgumentError, TrainingArguments
from .args_cli import ArgumentParser, parse_args
from .checkpoint import find_latest_checkpoint, load_checkpoint, save_checkpoint
from .callbacks import TrainerCallback, TrainerControl
from .trainer import (EvalLoopOutput, EvalPrediction, PredictionOutput, Trainer, TrainerState, TrainOutput,
                      get_scheduler, set_seed)
from .backends import available_backends
from .env import DistEnv, LaunchError, LaunchInfo, read_launch_env

__version__ = "0.1.0"

__all__ = [
    "ArgumentError",
    "ArgumentParser",
    "EvalLoopOutput",
    "EvalPrediction",
    "PredictionOutput",
    "Trainer",
    "TrainerCallback",
    "TrainerControl",
    "TrainerState",
    "TrainOutput",
    "TrainingArguments",
    "find_latest_checkpoint",
    "get_scheduler",
    "load_checkpoint",
    "parse_args",
    "save_checkpoint",
    "set_seed",
    "Comm",
    "DistEnv",
    "DistributedDataParallel",
    "DistributedSampler",
    "LengthGroupedSampler",
    "Join",
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
    "PeerLeftError",
    "PeerVanishedError",
    "DeadlockError",
    "ZeroRedundancyOptimizer",
    "AgreedGradScaler",
]
