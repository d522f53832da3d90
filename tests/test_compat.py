"""accelerate drives ddpkit's DDP exactly where it would drive torch's, and gets torch's result."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import clean_env, free_port

SCRIPT = str(Path(__file__).parent / "scripts" / "accelerate_swap.py")


def _accelerate(out: Path, *extra: str) -> list[dict]:
    command = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
               SCRIPT, str(out), *extra]
    proc = subprocess.Popen(command, env=clean_env(OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.skipif(shutil.which("accelerate") is None, reason="accelerate is a dev extra")
def test_accelerate_prepare_builds_ours_and_matches_torch(tmp_path):
    ours = _accelerate(tmp_path / "ours")
    theirs = _accelerate(tmp_path / "torch", "--torch")
    assert ours[0]["wrapper"] == "ddpkit.ddp.DistributedDataParallel"
    assert theirs[0]["wrapper"] == "torch.nn.parallel.distributed.DistributedDataParallel"
    assert all(r["unwrapped_is_inner"] and r["world"] == 2 for r in ours)
    assert ours[0]["params"] == ours[1]["params"], "replicas differ"
    for mine, reference in zip(ours[0]["params"], theirs[0]["params"]):
        assert max(abs(a - b) for a, b in zip(mine, reference)) < 1e-6
