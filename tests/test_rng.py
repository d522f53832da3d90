"""ddpkit.rng: a rank's random state restored, its GPU's included, wherever the resume runs."""

from __future__ import annotations

import random

import torch

from ddpkit.rng import rng_state, set_rng_state


def test_the_cpu_generators_come_back():
    state = rng_state()
    drawn_python, drawn_torch = random.random(), torch.rand(3)
    set_rng_state(state)
    assert random.random() == drawn_python and torch.equal(torch.rand(3), drawn_torch)


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
