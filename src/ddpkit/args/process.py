"""What a Transformers training script reads off its TrainingArguments about the process it runs in, before any
Trainer exists (its example scripts log it, and tokenize under main_process_first):

    logger.setLevel(args.get_process_log_level())
    logger.warning(f"rank {args.process_index}, device {args.device}, distributed: "
                   f"{args.parallel_mode.value == 'distributed'}")
    with args.main_process_first(desc="tokenizing"):     # rank 0 first (its cache), then the others
        dataset = dataset.map(tokenize)

Read from the launcher's environment (ddpkit.distributed.env), without a process group and without pinning a device; only
main_process_first joins the world (as the Trainer would, with the same arguments). Transformers' names and
meanings; log_on_each_node is Transformers' default (True) and log_level "passive".
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import logging
from collections.abc import Iterator

import torch

from ddpkit.distributed.backends import default_device_type, node_device_index
from ddpkit.distributed.env import LaunchInfo, read_launch_env


class ParallelMode(enum.Enum):
    """Transformers' values: a script compares `args.parallel_mode.value == "distributed"`."""

    NOT_PARALLEL = "not_parallel"
    NOT_DISTRIBUTED = "not_distributed"
    DISTRIBUTED = "distributed"


class ProcessMixin:
    """TrainingArguments' (it has use_cpu, ddp_backend, ddp_timeout and ddp_stall_seconds)."""

    use_cpu: bool
    ddp_backend: str | None
    ddp_timeout: float
    ddp_stall_seconds: float | None

    @property
    def _launch(self) -> LaunchInfo:
        return read_launch_env()

    @property
    def process_index(self) -> int:
        """This process's global rank."""
        return self._launch.rank

    @property
    def local_process_index(self) -> int:
        """This process's rank on its node."""
        return self._launch.local_rank

    @property
    def world_size(self) -> int:
        """How many processes train."""
        return self._launch.world_size

    @property
    def device(self) -> torch.device:
        """The device this process trains on: its node rank's accelerator, or the CPU (use_cpu, or none)."""
        kind = "cpu" if self.use_cpu else default_device_type()
        if kind == "cpu":
            return torch.device("cpu")
        return torch.device(kind, node_device_index(self.local_process_index, getattr(torch, kind).device_count()))

    @property
    def n_gpu(self) -> int:
        """GPUs this process uses: one on a GPU (ddpkit runs no DataParallel), none on the CPU."""
        return int(self.device.type == "cuda")

    @property
    def parallel_mode(self) -> ParallelMode:
        launch = self._launch
        return ParallelMode.DISTRIBUTED if launch.world_size > 1 or launch.launcher != "none" \
            else ParallelMode.NOT_PARALLEL

    @property
    def should_log(self) -> bool:
        """Whether this process logs: the first of each node (Transformers' log_on_each_node default)."""
        return self._launch.is_local_main

    @property
    def should_save(self) -> bool:
        """Whether this process writes checkpoints and files: rank 0."""
        return self._launch.is_main

    @property
    def ddp_timeout_delta(self) -> datetime.timedelta:
        """ddp_timeout as a timedelta (Transformers' name; what init_process_group takes)."""
        return datetime.timedelta(seconds=self.ddp_timeout)

    @property
    def push_to_hub(self) -> bool:
        """Always False: ddpkit uploads nothing (a script reads it to choose create_model_card)."""
        return False

    def get_process_log_level(self) -> int:
        """The log level for this process, as Transformers' for log_level "passive" and log_level_replica
        "warning": Transformers' current verbosity where this process logs, WARNING on the others."""
        if not self.should_log:
            return logging.WARNING
        try:
            from transformers.utils import logging as transformers_logging
        except ImportError:
            return logging.WARNING  # Transformers' own default verbosity
        return transformers_logging.get_verbosity()

    @contextlib.contextmanager
    def main_process_first(self, local: bool = True, desc: str = "work") -> Iterator[None]:
        """Run the body on the main process first (node-local with local=True, as Transformers' default), then on
        the others; joins the world the launcher described, as the Trainer will (the same arguments). desc:
        Transformers' label of the work, taken for its signature."""
        if self.world_size == 1:
            yield
            return
        from ddpkit.distributed.comm import main_process_first
        from ddpkit.world import init_process_group

        world = init_process_group(backend=self.ddp_backend, timeout=self.ddp_timeout,
                                   device_type="cpu" if self.use_cpu else None, stall_seconds=self.ddp_stall_seconds)
        with main_process_first(world, local=local):
            yield


__all__ = ["ParallelMode", "ProcessMixin"]
