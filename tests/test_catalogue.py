"""The bad-input catalogue: each wrong use, the error it gets, and the words that tell the user what to fix.

One table, one row per wrong use. A row is (name, how to commit the mistake, the exception, a pattern the
message must match). Mistakes that need several processes run in one spawned world at the end.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch

import ddpkit
import ddpkit.distributed.env
from helpers import models
from helpers.world import free_port, run_world


def _launch_env(port: int, world_size: int = 2) -> dict[str, str]:
    return {"RANK": "0", "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def unknown_backend():
    ddpkit.init_process_group(backend="nccI")  # a capital I for an l


def nccl_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    ddpkit.init_process_group(backend="nccl")


def nccl_without_cuda_in_args():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    ddpkit.TrainingArguments(output_dir="unused", ddp_backend="nccl")


def zero_bucket():
    ddpkit.DistributedDataParallel(models.MLP(), bucket_cap_mb=0)


def negative_bucket_in_args():
    ddpkit.TrainingArguments(output_dir="unused", ddp_bucket_cap_mb=-5)


def stall_threshold_beyond_timeout():
    ddpkit.TrainingArguments(output_dir="unused", ddp_timeout=60, ddp_stall_seconds=90)


def infinite_logging_steps():
    ddpkit.TrainingArguments(output_dir="unused", logging_steps=float("inf"))


def zero_timeout():
    ddpkit.init_process_group(timeout=0)


def negative_timeout_in_args():
    ddpkit.TrainingArguments(output_dir="unused", ddp_timeout=-1)


def world_size_too_large():
    environ = _launch_env(free_port(), world_size=3)
    os.environ.update(environ)  # env:// reads them too; the fixture restores the environment
    ddpkit.distributed.env.init_process_group(backend="gloo", environ=environ, join_timeout=2)


def port_in_use():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        environ = _launch_env(taken.getsockname()[1])
        os.environ.update(environ)
        ddpkit.distributed.env.init_process_group(backend="gloo", environ=environ, join_timeout=5)


def rank_outside_world():
    ddpkit.read_launch_env({"RANK": "4", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"})


def checkpoint_of_another_model(tmp_path):
    from ddpkit.checkpoint import files as checkpoint
    from ddpkit.checkpoint import folders

    folder = tmp_path / "checkpoint-3"
    folder.mkdir()
    checkpoint.save_weights(models.MLP(hidden=16), str(folder / checkpoint.MODEL_FILE))
    checkpoint.write_json(str(folder / folders.TRAINER_STATE_FILE), {"global_step": 3})
    checkpoint.load_checkpoint(str(folder), model=models.MLP(hidden=32))


def unwritable_output_dir(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    ddpkit.TrainingArguments(output_dir=str(blocker / "run"))


def device_ids_for_a_cpu_model():
    ddpkit.DistributedDataParallel(models.MLP(), device_ids=[0])


def sparse_embedding():
    ddpkit.DistributedDataParallel(torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True)))


def frozen_module():
    ddpkit.DistributedDataParallel(models.MLP().requires_grad_(False))


def lazy_module():
    ddpkit.DistributedDataParallel(torch.nn.LazyLinear(4))


def dataset_smaller_than_world_with_drop_last():
    ddpkit.DistributedSampler(list(range(3)), num_replicas=4, rank=0, drop_last=True)


CATALOGUE = [
    ("unknown backend", unknown_backend, ValueError, r"unknown backend 'nccI'.*available on this machine: .*gloo"),
    ("nccl without CUDA", nccl_without_cuda, ValueError,
     r"nccl.*(needs CUDA|this torch build has no NCCL).*available on this machine"),
    ("nccl without CUDA (args)", nccl_without_cuda_in_args, ddpkit.ArgumentError, r"ddp_backend"),
    ("non-positive bucket size", zero_bucket, ValueError, r"bucket_cap_mb must be a positive"),
    ("non-positive bucket size (args)", negative_bucket_in_args, ddpkit.ArgumentError, r"ddp_bucket_cap_mb"),
    ("stall threshold not below the timeout (args)", stall_threshold_beyond_timeout, ddpkit.ArgumentError,
     r"ddp_stall_seconds.*below ddp_timeout"),
    ("infinite logging steps (args)", infinite_logging_steps, ddpkit.ArgumentError, r"logging_steps.*finite"),
    ("non-positive timeout", zero_timeout, ValueError, r"timeout must be positive"),
    ("non-positive timeout (args)", negative_timeout_in_args, ddpkit.ArgumentError, r"ddp_timeout"),
    ("world size larger than the processes", world_size_too_large, ddpkit.LaunchError,
     r"WORLD_SIZE.*start exactly"),
    ("port in use", port_in_use, ddpkit.LaunchError, r"MASTER_PORT \d+ is already in use.*free port"),
    ("rank outside the world", rank_outside_world, ddpkit.LaunchError, r"rank 4 is outside the world of 4"),
    ("checkpoint of another model", checkpoint_of_another_model, ValueError,
     r"(?s)weights of another model.*size mismatch for net.0.weight.*Resume with the model"),
    ("output_dir that cannot be written", unwritable_output_dir, ddpkit.ArgumentError,
     r"output_dir.*is a file, not a folder"),
    ("device_ids for a CPU model", device_ids_for_a_cpu_model, ValueError, r"leave device_ids=None"),
    ("sparse gradients", sparse_embedding, NotImplementedError, r"'0' produces sparse gradients.*sparse=False"),
    ("no parameter requires a gradient", frozen_module, RuntimeError, r"at least one parameter that requires"),
    ("a lazy module not yet run", lazy_module, RuntimeError, r"'weight' is not initialised.*forward pass"),
    ("data set smaller than the world (drop_last)", dataset_smaller_than_world_with_drop_last, ValueError,
     r"empty shard.*drop_last=False"),
]


@pytest.fixture
def clean_environment(monkeypatch):
    saved = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    yield
    os.environ.clear()
    os.environ.update(saved)
    ddpkit.destroy_process_group()


@pytest.mark.parametrize("name, mistake, error, pattern", CATALOGUE, ids=[row[0] for row in CATALOGUE])
def test_catalogue(name, mistake, error, pattern, tmp_path, clean_environment):
    args = (tmp_path,) if mistake.__code__.co_argcount else ()
    with pytest.raises(error, match=pattern):
        mistake(*args)


def mistakes_across_ranks(world):
    """The mistakes only a world of several processes can make; every rank must get the error."""
    import ddpkit
    from ddpkit.trainer.trainer import Trainer

    found = {}
    try:  # a model that differs on one rank
        ddpkit.DistributedDataParallel(models.MLP(hidden=32 if world.rank == 0 else 33))
    except RuntimeError as exc:
        found["model differs"] = str(exc)
    try:  # a data set smaller than the world
        args = ddpkit.TrainingArguments(output_dir=os.path.join(os.environ["CATALOGUE_TMP"], "tiny"),
                                        disable_tqdm=True)
        data = [{"x": torch.zeros(12), "labels": torch.tensor(0)}]
        Trainer(models.MLP(), args, train_dataset=data).train()
    except ValueError as exc:
        found["data smaller than world"] = str(exc)
    return found


def test_catalogue_across_ranks(tmp_path):
    for found in run_world(mistakes_across_ranks, 2, env={"CATALOGUE_TMP": str(tmp_path)}):
        assert "rank 1" in found.get("model differs", "") and "[33, 12]" in found["model differs"], found
        assert "1 sample(s) but 2 processes" in found.get("data smaller than world", ""), found
