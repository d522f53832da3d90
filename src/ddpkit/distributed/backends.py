"""Which collective backend: the one for a device, those this machine can run, and a check that names them.

    backend_for_device("cuda")    # "nccl"; xpu: xccl, npu and hpu: hccl, mlu: cncl, cpu: gloo
    check_backend("cpu:gloo,cuda:nccl")   # torch's spellings; a clear ValueError for one that cannot run here
"""

from __future__ import annotations

import torch
import torch.distributed as dist

DEVICE_BACKENDS = {"cuda": "nccl", "xpu": "xccl", "npu": "hccl", "hpu": "hccl", "mlu": "cncl", "cpu": "gloo"}
KNOWN_BACKENDS = ("nccl", "gloo", "xccl", "hccl", "cncl", "mpi", "ucc")


def available_backends() -> list[str]:
    """The collective backends this torch build can use on this machine."""
    found = []
    if dist.is_gloo_available():
        found.append("gloo")
    if dist.is_nccl_available() and torch.cuda.is_available():
        found.append("nccl")
    if getattr(dist, "is_xccl_available", lambda: False)() and hasattr(torch, "xpu") and torch.xpu.is_available():
        found.append("xccl")
    if dist.is_mpi_available():
        found.append("mpi")
    if getattr(dist, "is_ucc_available", lambda: False)():
        found.append("ucc")
    # Registered by vendor plug-ins: hccl by torch_npu (Ascend) and Habana's (Gaudi, torch.hpu), cncl by torch_mlu.
    for name, modules in (("hccl", ("npu", "hpu")), ("cncl", ("mlu",))):
        if any(hasattr(torch, m) for m in modules) and name in getattr(dist.Backend, "backend_list", []):
            found.append(name)
    return found


def default_device_type() -> str:
    """The accelerator this process should use, or cpu."""
    if torch.cuda.is_available():
        return "cuda"
    for kind in ("xpu", "npu", "mlu", "hpu"):
        module = getattr(torch, kind, None)
        if module is not None and getattr(module, "is_available", lambda: False)():
            return kind
    return "cpu"


def node_device_index(local_rank: int, count: int) -> int:
    """The device index of the process with `local_rank` on a node showing `count` devices: its local rank, or 0
    where each process sees one device, bound to it (SLURM --gpus-per-task=1, CUDA_VISIBLE_DEVICES per rank)."""
    return 0 if count == 1 else local_rank


def backend_for_device(device_type: str) -> str:
    try:
        return DEVICE_BACKENDS[device_type]
    except KeyError:
        raise ValueError(f"no default backend for device type {device_type!r}; pass backend= explicitly") from None


def _built(name: str) -> bool:
    """Whether this torch build has backend `name` (its device may still be absent)."""
    probe = getattr(dist, f"is_{name}_available", None)
    return probe() if probe is not None else name in getattr(dist.Backend, "backend_list", [])


def check_backend(backend: str) -> None:
    """Fail at once, naming what is available, when `backend` cannot run here. Names as torch takes them: in any
    case ("GLOO"), or one per device ("cpu:gloo,cuda:nccl")."""
    available = available_backends()
    for device, _, name in (part.strip().lower().rpartition(":") for part in backend.split(",")):
        absent = device not in ("", "cpu") and not getattr(getattr(torch, device, None), "is_available", bool)()
        if absent and name in KNOWN_BACKENDS and _built(name):
            continue  # "cuda:nccl" for the GPUs of another machine the same script runs on: unused here
        if name not in KNOWN_BACKENDS:
            raise ValueError(f"unknown backend {backend!r}: choose one of {', '.join(KNOWN_BACKENDS)}, or one per "
                             f"device as 'cpu:gloo,cuda:nccl' (available on this machine: "
                             f"{', '.join(available) or 'none'})")
        if name not in available:
            why = "" if name != "nccl" else " (this torch build has no NCCL)" if not _built(name) else \
                " (nccl needs CUDA GPUs, and none is visible)"
            raise ValueError(f"backend {name!r} is not available here{why}; "
                             f"available on this machine: {', '.join(available) or 'none'}")


__all__ = ["DEVICE_BACKENDS", "KNOWN_BACKENDS", "available_backends", "backend_for_device", "check_backend",
           "default_device_type", "node_device_index"]
