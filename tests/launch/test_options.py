"""The plan of `ddpkit launch` (ddpkit.launch.options): torchrun's flags through torch's own parser, the PET_*
variables, rendezvous choices and bad input, without starting any process."""

from __future__ import annotations

import argparse
import os
import sys
import unittest.mock

import pytest

from ddpkit import cli
from ddpkit.launch import launcher as launch
from ddpkit.launch import options as launch_plan


def parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["launch", *argv])


def plan(*argv: str, **environ: str) -> launch.LaunchPlan:
    """The plan of `ddpkit launch argv` in `environ`. torchrun's parser reads PET_* when it is built (not when
    the plan is made), so they are in os.environ while it parses."""
    pet = {k: v for k, v in environ.items() if k.startswith("PET_")}
    with unittest.mock.patch.dict(os.environ, pet):
        args = parse(*argv)
    return launch.plan_launch(args, environ)


def test_torchruns_own_flags_are_refused_with_the_reason(capsys):
    with pytest.raises(ValueError, match="--tee is torchrun's and not ddpkit launch's: every rank's output already"):
        plan("--tee", "3", "t.py")
    with pytest.raises(ValueError, match="--local-ranks-filter"):
        plan("t.py", PET_LOCAL_RANKS_FILTER="0")
    p = plan("--start-method", "fork", "--signals-to-handle", "SIGTERM,SIGUSR1", "--shutdown-timeout", "7", "t.py")
    assert (p.start_method, p.signals, p.shutdown_timeout) == ("fork", "SIGTERM,SIGUSR1", 7.0)
    assert plan("t.py", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="12").shutdown_timeout == 12.0  # as torchrun
    assert plan("t.py").shutdown_timeout == 30.0
    with pytest.raises(SystemExit):
        cli.main(["launch", "--help"])  # torchrun's flags, with ddpkit's meaning where it has its own
    shown = capsys.readouterr().out
    assert "--rdzv-endpoint" in shown and "--start-method" in shown and "LOG_DIR/rank<R>.log" in shown


def test_one_node_by_default_on_loopback_with_torchrun_environment():
    p = plan("--nproc-per-node", "2", "train.py", "--lr", "3", "--nproc-per-node", "9")
    assert p.rdzv_backend == "loopback" and p.min_nodes == p.max_nodes == 1 and p.nproc_per_node == 2
    assert p.command == (sys.executable, "-u", "train.py", "--lr", "3", "--nproc-per-node", "9")  # script's own
    assert p.worker_env["OMP_NUM_THREADS"] == str(max(1, launch_plan.cpu_cores() // 2))
    assert p.worker_env.get("GLOO_SOCKET_IFNAME", "lo") == "lo"
    assert plan("--standalone", "--nnodes", "3", "t.py").rdzv_backend == "loopback"
    assert plan("t.py", OMP_NUM_THREADS="7").worker_env.get("OMP_NUM_THREADS") is None  # the user's value stays


def test_static_and_c10d_rendezvous_follow_torchrun():
    p = plan("--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "t.py")
    assert (p.rdzv_backend, p.rdzv_endpoint, p.rdzv_configs["rank"]) == ("static", "10.0.0.1:29500", 1)
    assert "GLOO_SOCKET_IFNAME" not in p.worker_env
    p = plan("--master-port", "1234", "t.py")  # a port given: static even on one node, as torchrun
    assert (p.rdzv_backend, p.rdzv_endpoint) == ("static", "127.0.0.1:1234")
    # one node names its own launch (its workers' TORCHELASTIC_RUN_ID); several must be told one (--rdzv-id)
    assert len(p.run_id) == 32 and p.run_id != plan("--master-port", "1234", "t.py").run_id
    assert plan("--nnodes", "2", "--master-addr", "10.0.0.1", "t.py").run_id == "none"
    assert plan("--master-port", "1234", "--rdzv-id", "mine", "t.py").run_id == "mine"
    p = plan("--nnodes", "1:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29400", "--rdzv-id", "j7",
             "--rdzv-conf", "is_host=1,join_timeout=5", "t.py")
    assert (p.min_nodes, p.max_nodes, p.rdzv_backend, p.run_id) == (1, 4, "c10d", "j7")
    assert p.rdzv_configs == {"is_host": "1", "join_timeout": "5", "timeout": launch_plan.RDZV_TIMEOUT_S}
    with pytest.raises(ValueError, match="node-rank"):
        plan("--nnodes", "2", "--node-rank", "2", "t.py")
    for bad, message in (("abc", "must be N or MIN:MAX"), ("2:1", "0 < MIN <= MAX"), ("0", "0 < MIN <= MAX")):
        with pytest.raises(ValueError, match=message):
            plan("--nnodes", bad, "t.py")
    with pytest.raises(ValueError, match="fixed --nnodes"):
        plan("--nnodes", "1:2", "--master-port", "5", "t.py")


def test_pet_variables_stand_in_for_flags_and_flags_win():
    p = plan("t.py", PET_NPROC_PER_NODE="3", PET_MAX_RESTARTS="2", PET_STANDALONE="1", PET_LOG_DIR="/x")
    assert (p.nproc_per_node, p.max_restarts, p.log_dir, p.rdzv_backend) == (3, 2, "/x", "loopback")
    assert plan("--nproc-per-node", "1", "t.py", PET_NPROC_PER_NODE="3").nproc_per_node == 1
    assert plan("t.py", PET_MODULE="1").command[-2:] == ("-m", "t.py")


def test_nproc_auto_entrypoint_kinds_and_bad_input():
    def gpus(n):
        return lambda kind: n if kind in ("auto", "gpu") else None

    assert launch_plan.resolve_nproc("auto", cores=6, count=gpus(0)) == 6
    assert launch_plan.resolve_nproc("auto", cores=64, count=gpus(4)) == 4
    assert launch_plan.resolve_nproc("cpu", cores=64, count=gpus(4)) == 64
    with pytest.raises(ValueError, match="no gpu"):
        launch_plan.resolve_nproc("gpu", cores=2, count=gpus(0))
    with pytest.raises(ValueError):
        launch_plan.resolve_nproc("many", cores=2, count=gpus(0))
    assert plan("-m", "pkg.train", "x").command == (sys.executable, "-u", "-m", "pkg.train", "x")
    assert plan("--no-python", "./run.sh", "x").command == ("./run.sh", "x")
    with pytest.raises(ValueError, match="exclude"):
        plan("--no-python", "-m", "pkg")
    assert cli.main(["launch", "--nproc-per-node", "0", "t.py"]) == 2  # a usage error, before any process


def test_nproc_counts_any_accelerator_as_torchrun(monkeypatch):
    """auto counts torch.accelerator's devices (on an XPU host CUDA's count alone gave the CPU cores), and xpu is a
    kind, as torchrun has them (found by torch's own test_run.py run against ddpkit launch)."""
    import types

    import torch

    def devices(n):
        return types.SimpleNamespace(is_available=lambda: n > 0, device_count=lambda: n)

    monkeypatch.setattr(torch, "accelerator", devices(3), raising=False)
    monkeypatch.setattr(torch, "xpu", devices(3), raising=False)
    assert launch_plan.resolve_nproc("auto", cores=2) == launch_plan.resolve_nproc("xpu", cores=2) == 3
    monkeypatch.setattr(torch, "accelerator", devices(0))
    monkeypatch.setattr(torch, "xpu", devices(0))
    assert launch_plan.resolve_nproc("auto", cores=2) == 2
    with pytest.raises(ValueError, match="no xpu device"):
        launch_plan.resolve_nproc("xpu", cores=2)
    assert launch_plan.device_count("tpu") is None

