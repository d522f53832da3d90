"""Every random generator a training step may draw from, saved and restored (checkpoint.py stores one per rank).

    state = rng_state()        # in types torch.load(weights_only=True) accepts
    set_rng_state(state)       # right before training goes on
    set_seed(42)               # python, numpy and torch seeded alike (the Trainer's args.seed)
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def set_seed(seed: int) -> None:
    """Seed python, numpy and torch (every device) in this process."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """This process's random state, in types torch.load(weights_only=True) accepts (no numpy objects)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # This process's own GPU only: a resume may see fewer GPUs than the save did (set_rng_state_all would
        # index past them), and the others' generators are other ranks' to keep.
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any] | None) -> None:
    """Restore what `rng_state` returned; None (no state saved for this rank) leaves the generators alone."""
    if state is None:
        return
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state((np_state["kind"], np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["gauss"]))
    torch.set_rng_state(state["cpu"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"]
        if isinstance(saved, (list, tuple)):  # an earlier ddpkit saved every visible GPU's: this one's, if there
            current = torch.cuda.current_device()
            saved = saved[current] if current < len(saved) else None
        if saved is not None:
            torch.cuda.set_rng_state(saved.cpu())


__all__ = ["rng_state", "set_rng_state", "set_seed"]
