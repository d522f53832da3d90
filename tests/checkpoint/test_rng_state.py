"""ddpkit.checkpoint.rng_state: a rank's random state restored, its GPU's included, wherever the resume runs."""

from __future__ import annotations

import random
import types
import warnings
import zipfile
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ddpkit.checkpoint.rng_state import numpy_allowed, rng_state, set_rng_state


def _draw():
    return random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist()


def test_the_cpu_generators_come_back():
    state = rng_state()
    drawn = _draw()
    set_rng_state(state)
    assert _draw() == drawn


def test_an_earlier_ddpkits_numpy_state_of_tensors_still_loads():
    state = rng_state()
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    old = {**state, "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                              "has_gauss": int(has_gauss), "gauss": float(gauss)}}
    drawn = _draw()
    set_rng_state(old)
    assert _draw() == drawn


def test_transformers_trainer_and_ddpkit_resume_from_each_others_rng_files(tmp_path):
    """Transformers' own _load_rng_state and _save_rng_state (rank 1 of 2), against ddpkit's files: an earlier
    ddpkit kept numpy's state as tensors, which Transformers' np.random.set_state refuses."""
    transformers = pytest.importorskip("transformers")
    from transformers.training_args import ParallelMode

    args = SimpleNamespace(world_size=2, process_index=1, parallel_mode=ParallelMode.DISTRIBUTED)
    trainer = SimpleNamespace(args=args)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir()
    torch.save(rng_state(), ours / "rng_state_1.pth")
    drawn = _draw()
    transformers.Trainer._load_rng_state(trainer, str(ours))
    assert _draw() == drawn

    transformers.Trainer._save_rng_state(trainer, str(theirs))
    drawn = _draw()
    with numpy_allowed():
        saved = torch.load(theirs / "rng_state_1.pth", weights_only=True)
    set_rng_state(saved)
    assert _draw() == drawn


def test_a_world_of_one_reads_and_writes_the_rng_file_of_a_transformers_trainer_of_one(tmp_path):
    """A Transformers Trainer of one process reads and writes rng_state.pth only: a ddpkit checkpoint of one
    rank has it too (with the same state as rng_state_0.pth), and ddpkit's load reads it where rng_state_0.pth
    is missing (a Transformers checkpoint), counting it as a world of one."""
    transformers = pytest.importorskip("transformers")
    import safetensors.torch
    from transformers.training_args import ParallelMode

    from ddpkit.checkpoint import files as checkpoint
    from helpers.models import save_small, trained_parts

    trainer = SimpleNamespace(args=SimpleNamespace(world_size=1, process_index=0,
                                                   parallel_mode=ParallelMode.NOT_DISTRIBUTED))
    model = trained_parts()[0]
    path = save_small(tmp_path / "ours", 3, model)
    drawn = _draw()
    transformers.Trainer._load_rng_state(trainer, path)
    assert _draw() == drawn

    theirs = tmp_path / "theirs" / "checkpoint-3"  # what a Transformers Trainer of one process leaves
    theirs.mkdir(parents=True)
    (theirs / "trainer_state.json").write_text('{"global_step": 3, "log_history": []}')
    safetensors.torch.save_file(model.state_dict(), str(theirs / "model.safetensors"))
    transformers.Trainer._save_rng_state(trainer, str(theirs))
    drawn = _draw()
    loaded = checkpoint.load_checkpoint(str(theirs))
    set_rng_state(loaded.rng_state)
    assert _draw() == drawn and loaded.saved_world_size == 1


def test_the_gpu_state_is_this_devices_and_old_lists_are_read(monkeypatch):
    """No GPU here: torch.cuda's calls are recorded. A state list an earlier ddpkit saved (every visible GPU's)
    gives this device's entry, or nothing when the resume sees fewer GPUs than the save did."""
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s: restored.append(s.tolist()))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: restored.append("all"))
    base = rng_state()
    for saved, expected in ((torch.tensor([7]), [[7]]), ([torch.tensor([5]), torch.tensor([6])], [[6]]),
                            ([torch.tensor([5])], [])):
        restored.clear()
        set_rng_state({**base, "cuda": saved})
        assert restored == expected, (saved, restored)


def _renamed(src, dst, old: bytes, new: bytes) -> None:
    """A torch.save file with `old` renamed `new` in its pickle (the same archive otherwise)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for item in zin.infolist():
            data = zin.read(item)
            zout.writestr(item, data.replace(old, new) if item.filename.endswith("data.pkl") else data)


def test_files_of_numpy_1_and_2_load_under_either(tmp_path, monkeypatch):
    """numpy 2 pickles numpy's state under numpy._core, numpy 1 under numpy.core: a file either wrote loads under
    this numpy, and under a numpy 1 whose numpy._core is a stub without multiarray (1.26's: taking the module by
    attribute failed every load there)."""
    torch.save(rng_state(), tmp_path / "two.pth")
    _renamed(tmp_path / "two.pth", tmp_path / "one.pth", b"numpy._core.multiarray", b"numpy.core.multiarray")
    drawn = _draw()
    for name in ("two.pth", "one.pth"):
        with numpy_allowed():
            set_rng_state(torch.load(tmp_path / name, weights_only=True))
        assert _draw() == drawn, name
    monkeypatch.setattr(np, "__version__", "1.26.4")
    monkeypatch.setattr(np, "_core", types.ModuleType("numpy._core"), raising=False)
    for name in ("two.pth", "one.pth"):
        with warnings.catch_warnings(), numpy_allowed():
            warnings.simplefilter("ignore", DeprecationWarning)  # numpy 2's numpy.core, where first imported
            set_rng_state(torch.load(tmp_path / name, weights_only=True))
        assert _draw() == drawn, name



@pytest.fixture
def determinism_restored(monkeypatch):
    """set_seed(deterministic=True) changes process-wide settings: put them back for the tests that follow."""
    for name in ("CUBLAS_WORKSPACE_CONFIG", "FLASH_ATTENTION_DETERMINISTIC"):
        monkeypatch.delenv(name, raising=False)
    cudnn = torch.backends.cudnn
    was = (torch.are_deterministic_algorithms_enabled(), cudnn.deterministic, cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(was[0])
    cudnn.deterministic, cudnn.benchmark = was[1:]


def test_set_seed_deterministic_seeds_alike_and_keeps_torch_to_deterministic_kernels(determinism_restored,
                                                                                      monkeypatch):
    import os

    from ddpkit.checkpoint.rng_state import set_seed

    set_seed(3)
    plain = _draw()
    assert not torch.are_deterministic_algorithms_enabled()
    set_seed(3, deterministic=True)
    assert _draw() == plain
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8" and os.environ["FLASH_ATTENTION_DETERMINISTIC"] == "1"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # the user's choice stays, where torch takes it
    set_seed(3, deterministic=True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")  # torch's deterministic cuBLAS would refuse it
    set_seed(3, deterministic=True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_the_trainer_s_full_determinism_sets_it(tmp_path, determinism_restored, local_world):
    from ddpkit.trainer.trainer import Trainer
    from helpers.models import Classifier, classification_data, trainer_args

    Trainer(Classifier(), trainer_args(tmp_path))
    assert not torch.are_deterministic_algorithms_enabled()
    args = trainer_args(tmp_path, full_determinism=True, max_steps=2, per_device_train_batch_size=4)
    trainer = Trainer(args=args, model_init=lambda: Classifier().double(), train_dataset=classification_data(8))
    assert torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    trainer.train()  # model_init's model is made anew, seeded as the construction seeded it
    assert torch.are_deterministic_algorithms_enabled() and trainer.state.global_step == 2
