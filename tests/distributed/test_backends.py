"""ddpkit.distributed.backends: the backend for each device, and clear refusals of those that cannot run here."""

from __future__ import annotations

import pytest
import torch

import ddpkit
from ddpkit.distributed.backends import backend_for_device, check_backend


def test_the_backend_of_each_device_and_clear_refusals():
    assert backend_for_device("cpu") == "gloo" and backend_for_device("cuda") == "nccl"
    assert backend_for_device("xpu") == "xccl" and backend_for_device("npu") == "hccl"
    assert backend_for_device("mlu") == "cncl"
    assert "gloo" in ddpkit.available_backends()
    with pytest.raises(ValueError, match="unknown backend 'glue'.*available on this machine: gloo"):
        check_backend("glue")
    for name in ("GLOO", "cpu:gloo"):  # as torch spells them
        check_backend(name)
    if torch.distributed.is_nccl_available():  # cuda:nccl for the GPU machines the same script runs on
        check_backend("cpu:gloo,cuda:nccl")
    else:  # refused here as torch refuses it, but saying so
        with pytest.raises(ValueError, match="backend 'nccl' is not available here .this torch build has no NCCL"):
            check_backend("cpu:gloo,cuda:nccl")
    with pytest.raises(ValueError, match="unknown backend 'cpu:glue'"):
        check_backend("cpu:glue")
    if not torch.cuda.is_available():
        why = "needs CUDA" if torch.distributed.is_nccl_available() else "this torch build has no NCCL"
        with pytest.raises(ValueError, match=f"nccl.*{why}.*available on this machine"):
            check_backend("nccl")
