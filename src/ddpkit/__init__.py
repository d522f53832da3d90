"""ddpkit: data-parallel training for PyTorch.

    world = ddpkit.init_process_group()                 # from torchrun / ddpkit launch / SLURM, or a world of one
    model = ddpkit.DistributedDataParallel(model)
    sampler = ddpkit.DistributedSampler(dataset)
"""

from ddpkit.args.parser import ArgumentParser, parse_args
from ddpkit.args.training_args import TrainingArguments
from ddpkit.checkpoint.files import load_checkpoint, save_checkpoint
from ddpkit.checkpoint.folders import find_latest_checkpoint
from ddpkit.data.length_sampler import LengthGroupedSampler
from ddpkit.data.sampler import DistributedSampler
from ddpkit.distributed.backends import available_backends
from ddpkit.distributed.comm import Comm, barrier, main_process_first
from ddpkit.distributed.env import DistEnv, LaunchInfo, read_launch_env
from ddpkit.engine.ddp import DistributedDataParallel
from ddpkit.engine.join import Join
from ddpkit.errors import (ArgumentError, DeadlockError, LaunchError, PeerFailedError, PeerLeftError, PeerVanishedError,
                           ReplicaDivergenceError, StallError)
from ddpkit.trainer.callbacks import TrainerCallback, TrainerControl
from ddpkit.trainer.precision import AgreedGradScaler
from ddpkit.trainer.trainer import (EvalLoopOutput, EvalPrediction, PredictionOutput, Trainer, TrainerState, TrainOutput,
                                    get_scheduler, set_seed)
from ddpkit.world import destroy_process_group, init_process_group
from ddpkit.zero.optimizer import ZeroRedundancyOptimizer

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
