"""accelerate drives ddpkit's DDP exactly where it would drive torch's, and gets torch's result."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from helpers.world import clean_env, free_port, two_at_a_time

SCRIPT = str(Path(__file__).parent.parent / "scripts" / "accelerate_swap.py")
HF_SCRIPT = str(Path(__file__).parent.parent / "scripts" / "hf_trainer_swap.py")


def _launch(command: list[str], timeout_s: float) -> None:
    """Run a 2-rank launch in its own session (killed at the deadline); it must exit 0."""
    proc = subprocess.Popen(command, env=clean_env(OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output[-3000:]


def _reports(out: Path) -> list[dict]:
    """Each rank's OUT/rank<r>.json."""
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _accelerate(out: Path) -> dict[str, list[dict]]:
    """One accelerate launch of SCRIPT, which trains with torch's wrapper and then with ours: both reports."""
    _launch(["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
             "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
             SCRIPT, str(out)], timeout_s=120)
    return {"ours": _reports(out / "ours"), "torch": _reports(out / "torch"), "zero": _reports(out / "zero")}


def _transformers(out: Path) -> dict[str, list[dict]]:
    """One torchrun launch of HF_SCRIPT, which trains with torch's wrapper and then with ours: both reports."""
    _launch([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
             str(free_port()), HF_SCRIPT, str(out)], timeout_s=240)
    return {"ours": _reports(out / "ours"), "torch": _reports(out / "torch")}


HAVE_ACCELERATE = shutil.which("accelerate") is not None
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


@pytest.fixture(scope="module")
def swap_runs(tmp_path_factory):
    """Each swap script launched once (it trains with torch's wrapper, then with ours): by run name, the future
    of both runs' reports (its result() raises the launch's failure in the test that reads it). The two
    launches at the same time: each spends much of its time on one core (the launcher's imports, then its
    workers'), so the other fills the second; each keeps its own deadline and is killed at it."""
    root = tmp_path_factory.mktemp("swap")
    runs = {}
    if HAVE_ACCELERATE:
        runs["accelerate"] = lambda: _accelerate(root / "accelerate")
    if HAVE_TRANSFORMERS:
        runs["transformers"] = lambda: _transformers(root / "transformers")
    return two_at_a_time(runs)


@pytest.mark.skipif(not HAVE_ACCELERATE, reason="accelerate is a dev extra")
def test_accelerate_prepare_builds_ours_and_matches_torch(swap_runs):
    reports = swap_runs["accelerate"].result()
    ours, theirs = reports["ours"], reports["torch"]
    assert ours[0]["wrapper"] == "ddpkit.engine.ddp.DistributedDataParallel"
    assert theirs[0]["wrapper"] == "torch.nn.parallel.distributed.DistributedDataParallel"
    assert all(r["unwrapped_is_inner"] and r["world"] == 2 for r in ours)
    assert ours[0]["params"] == ours[1]["params"], "replicas differ"
    for mine, reference in zip(ours[0]["params"], theirs[0]["params"]):
        assert max(abs(a - b) for a, b in zip(mine, reference)) < 1e-6
    # prepare(model, ddpkit.ZeroRedundancyOptimizer): AcceleratedOptimizer reads its state_dict at once (torch's
    # class raises there); SGD on flat shards steps the same bits.
    zero = reports["zero"]
    assert zero[0]["params"] == zero[1]["params"] == ours[0]["params"]


@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers is a dev extra")
def test_transformers_trainer_trains_with_ours_as_with_torchs(swap_runs):
    """transformers.Trainer on 2 gloo ranks, gradient accumulation under no_sync, the ddp_* fields passed on."""
    reports = swap_runs["transformers"].result()
    ours, theirs = reports["ours"], reports["torch"]
    assert ours[0]["wrapper"] == "ddpkit.engine.ddp.DistributedDataParallel"
    assert theirs[0]["wrapper"] == "torch.nn.parallel.distributed.DistributedDataParallel"
    assert all(r["world"] == 2 for r in ours + theirs)
    assert ours[0]["settings"] == theirs[0]["settings"] == [1024 * 1024, False, False]
    assert ours[0]["synced"] == 4, "4 optimizer steps of 2 micro-batches: only every second backward syncs"
    assert len(ours[0]["losses"]) == len(theirs[0]["losses"]) == 4
    for mine, reference in zip(ours[0]["losses"], theirs[0]["losses"]):
        assert abs(mine - reference) <= 1e-5, (ours[0]["losses"], theirs[0]["losses"])
    assert ours[0]["params"] == ours[1]["params"], "replicas differ"
    assert max(abs(a - b) for a, b in zip(ours[0]["params"], theirs[0]["params"])) <= 1e-4


# -- torch's contract beyond the training loop: pickling, ignored parameters, buffers at init, torch's hooks -------
def _mlp_step(r, n):
    """One step of a wrapper against one process on the concatenated batch: the largest gradient difference."""
    from helpers import models

    def step(ddp, ref, seed):
        x, y = models.batch("mlp", 4 * n, seed=seed)
        for p in [*ddp.parameters(), *ref.parameters()]:
            p.grad = None
        models.loss("mlp", ddp, x[4 * r:4 * r + 4], y[4 * r:4 * r + 4], r, 0).backward()
        (sum(models.loss("mlp", ref, x[4 * k:4 * k + 4], y[4 * k:4 * k + 4], k, 0) for k in range(n)) / n).backward()
        return max((p.grad - q.grad).abs().max().item() for p, q in zip(ddp.module.parameters(), ref.parameters()))

    return step


def _pickled(step, out):
    """torch.save of the whole wrapper, loaded back: a fresh reducer on the default group that trains as before."""
    import copy
    import io

    from helpers import models
    import torch

    import ddpkit

    torch.manual_seed(0)
    model = models.MLP()
    ref = copy.deepcopy(model)
    ddp = ddpkit.DistributedDataParallel(model, bucket_cap_mb=0.002)
    step(ddp, ref, seed=1)
    buffer = io.BytesIO()
    torch.save(ddp, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    out["loaded type"] = type(loaded).__name__
    out["fresh reducer"] = loaded.reducer is not None and loaded.reducer is not ddp.reducer
    out["loaded settings"] = (loaded.bucket_cap_mb, loaded.forward_sync_buffers, loaded.require_backward_grad_sync)
    out["loaded errors"] = [step(loaded, ref, seed=2 + k) for k in range(3)]  # its own gradients, averaged
    out["loaded buckets"] = len(loaded.bucket_plan)
    out["deepcopy error"] = step(copy.deepcopy(loaded), ref, seed=9)
    older = ddp.__getstate__()  # as an earlier ddpkit pickled it: without the buffer count kept since
    del older["_buffers_seen"]
    again = ddpkit.DistributedDataParallel.__new__(ddpkit.DistributedDataParallel)
    again.__setstate__(older)
    out["older pickle error"] = step(again, ref, seed=10)
    try:
        torch.save(ddpkit.DistributedDataParallel(models.MLP(), process_group=dist.new_group([0, 1])), io.BytesIO())
        out["other group"] = "saved"
    except RuntimeError as exc:
        out["other group"] = str(exc)


def _ignored_and_buffers(r, out):
    """torch's ignore list (the named parameter and buffer are neither reduced nor broadcast); buffers at
    construction: broadcast_buffers=False keeps them out, forward_sync_buffers=False does not."""
    from helpers import models
    import torch

    import ddpkit

    torch.manual_seed(1 + r)  # every rank another model: what init broadcasts shows
    model = models.ConvBN()
    with torch.no_grad():
        model.bn1.running_mean.fill_(float(r))
    ddpkit.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, ["head.bias", "bn1.running_mean"])
    ddp = ddpkit.DistributedDataParallel(model)
    out["ignored bias"] = model.head.bias.tolist()
    out["kept weight"] = model.head.weight.tolist()
    out["ignored buffer"] = model.bn1.running_mean.tolist()
    out["ignored in plan"] = any("head.bias" in bucket for bucket in ddp.bucket_plan)
    for label, kwargs in (("broadcast_buffers=False", {"broadcast_buffers": False}),
                          ("forward_sync_buffers=False", {"forward_sync_buffers": False})):
        model = models.ConvBN()
        with torch.no_grad():
            model.bn1.running_var.fill_(float(r + 1))
        ddp = ddpkit.DistributedDataParallel(model, **kwargs)
        out[label] = (model.bn1.running_var[0].item(), ddp.will_sync_module_buffers())
    out["will sync by default"] = ddpkit.DistributedDataParallel(models.ConvBN()).will_sync_module_buffers()


def drop_in_world(world):
    import copy

    from helpers import models
    import torch

    import ddpkit

    out = {}
    step = _mlp_step(world.rank, world.world_size)
    _pickled(step, out)
    _ignored_and_buffers(world.rank, out)
    # torch's built-in comm hook, logging data.
    torch.manual_seed(2)
    model = models.MLP()
    ref = copy.deepcopy(model)
    ddp = ddpkit.DistributedDataParallel(model)
    ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    out["fp16 hook error"] = max(step(ddp, ref, seed=20 + k) for k in range(2))
    data = ddp._get_ddp_logging_data()
    out["logging"] = {k: data[k] for k in ("world_size", "rank", "backend_name", "iteration", "comm_hook")}
    out["bucket sizes"] = data["bucket_sizes"]
    out["join group is the world"] = ddp.join_process_group is dist.distributed_c10d._get_default_group()
    return out


def test_pickle_ignore_list_buffers_at_init_and_torch_hooks():
    from helpers.world import run_world

    a, b = run_world(drop_in_world, 2)
    assert a["loaded type"] == "DistributedDataParallel" and a["fresh reducer"]
    assert a["loaded settings"] == (0.002, True, True)
    assert all(err <= 1e-6 for err in a["loaded errors"] + b["loaded errors"]), (a["loaded errors"], b["loaded errors"])
    assert a["loaded buckets"] > 1 and a["deepcopy error"] <= 1e-6 and a["older pickle error"] <= 1e-6
    assert "default process group" in a["other group"], a["other group"]
    assert a["kept weight"] == b["kept weight"], "a parameter not on the ignore list was not broadcast"
    assert a["ignored bias"] != b["ignored bias"], "an ignored parameter was broadcast"
    assert a["ignored buffer"] != b["ignored buffer"], "an ignored buffer was broadcast"
    assert not a["ignored in plan"]
    assert (a["broadcast_buffers=False"], b["broadcast_buffers=False"]) == ((1.0, False), (2.0, False))
    assert (a["forward_sync_buffers=False"], b["forward_sync_buffers=False"]) == ((1.0, False), (1.0, False))
    assert a["will sync by default"] is True
    assert 0 < a["fp16 hook error"] <= 1e-2  # rounded to half precision: changed, but only a little
    assert a["logging"] == {"world_size": 2, "rank": 0, "backend_name": "gloo", "iteration": 2,
                            "comm_hook": "_compress_hook.<locals>.hook"}
    assert a["bucket sizes"] and a["join group is the world"]
