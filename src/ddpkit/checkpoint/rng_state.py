"""Every random generator a training step may draw from, saved and restored (files.py stores one per rank).

    state = rng_state()        # Transformers' layout: what its Trainer saves in rng_state_<rank>.pth and resumes
    set_rng_state(state)       # right before training goes on
    with numpy_allowed(): torch.load(path, weights_only=True)   # numpy's state inside, as Transformers loads it
    set_seed(42)               # python, numpy and torch seeded alike (the Trainer's args.seed)
    set_seed(42, deterministic=True)   # and deterministic kernels only (the Trainer's full_determinism)
"""

from __future__ import annotations

import contextlib
import importlib
import os
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch


def set_seed(seed: int, deterministic: bool = False) -> None:
    """Seed python, numpy and torch (every device) in this process; deterministic (Transformers' argument, and its
    full_determinism): also restrict torch to deterministic kernels (an operation that has none raises), cuDNN to
    its deterministic algorithms without autotuning, cuBLAS to a fixed workspace (CUBLAS_WORKSPACE_CONFIG :16:8,
    unless it is :4096:8 already, the other value torch takes; read at the first cuBLAS call) and flash attention
    to its deterministic backward. Unlike
    Transformers' full_determinism, CUDA_LAUNCH_BLOCKING is left alone: it serialises every kernel and adds nothing
    to determinism since CUDA 10.2."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":16:8", ":4096:8"):  # torch refuses any other
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"
        os.environ["FLASH_ATTENTION_DETERMINISTIC"] = "1"
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def rng_state() -> dict[str, Any]:
    """This process's random state, laid out as Transformers' Trainer saves it, so that each can resume from the
    other's rng_state_<rank>.pth: numpy's as np.random.get_state() gives it (torch.load(weights_only=True) takes
    it inside `numpy_allowed`, as Transformers' Trainer loads it)."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # This process's own GPU only: a resume may see fewer GPUs than the save did (set_rng_state_all would
        # index past them), and the others' generators are other ranks' to keep.
        state["cuda"] = torch.cuda.get_rng_state()
    return state


@contextlib.contextmanager
def numpy_allowed() -> Iterator[None]:
    """torch.load(weights_only=True) taking the numpy objects of numpy's random state (an array and its dtype),
    nothing else beyond its defaults. torch before 2.5 has no scoped allowlist: there they are allowed for good."""
    # numpy 2 pickles its arrays as numpy._core's, numpy 1 as numpy.core's (numpy 1.26 has a numpy._core stub
    # without multiarray): this numpy's own, and under the other's name too where torch takes one (2.5 on).
    names = ["numpy._core.multiarray", "numpy.core.multiarray"]
    if int(np.__version__.split(".")[0]) < 2:
        names.reverse()
    reconstruct = importlib.import_module(names[0])._reconstruct
    allow: list[Any] = [reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    scoped = getattr(torch.serialization, "safe_globals", None)
    if scoped is None:
        torch.serialization.add_safe_globals(allow)
        yield
        return
    with scoped([*allow, *((reconstruct, f"{name}._reconstruct") for name in names)]):
        yield


def set_rng_state(state: dict[str, Any] | None) -> None:
    """Restore what `rng_state` returned; None (no state saved for this rank) leaves the generators alone."""
    if state is None:
        return
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    if isinstance(np_state, dict):  # an earlier ddpkit saved it as tensors and numbers
        np_state = (np_state["kind"], np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                    np_state["has_gauss"], np_state["gauss"])
    np.random.set_state(tuple(np_state))
    torch.set_rng_state(state["cpu"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"]
        if isinstance(saved, (list, tuple)):  # an earlier ddpkit saved every visible GPU's: this one's, if there
            current = torch.cuda.current_device()
            saved = saved[current] if current < len(saved) else None
        if saved is not None:
            torch.cuda.set_rng_state(saved.cpu())


__all__ = ["numpy_allowed", "rng_state", "set_rng_state", "set_seed"]
