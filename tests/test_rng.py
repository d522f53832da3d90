"""ddpkit.rng: a rank's random state restored, its GPU's included, wherever the resume runs."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ddpkit.rng import numpy_allowed, rng_state, set_rng_state


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
