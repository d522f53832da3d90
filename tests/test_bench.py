"""The benchmark's plumbing: the summary and options as plain functions, then one tiny end-to-end run.

No timing is asserted anywhere: the machine is shared and noisy, and the benchmark exists to measure it.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from ddpkit import bench


def test_round_order_rotates_so_each_variant_runs_first_once():
    orders = [bench.round_order(r) for r in range(3)]
    assert orders == [["ddpkit", "torch", "bare"], ["torch", "bare", "ddpkit"], ["bare", "ddpkit", "torch"]]
    assert {order[0] for order in orders} == set(bench.VARIANTS)
    assert bench.round_order(3) == orders[0]


def test_summary_ratio_is_median_of_per_round_ratios():
    # Rounds in seconds; round 1 is slow for everyone (a noisy neighbour), which per-round ratios cancel.
    steps = {"ddpkit": [[0.011, 0.010, 0.012], [0.022, 0.020, 0.024]],
             "torch": [[0.010, 0.010, 0.010], [0.020, 0.020, 0.020]],
             "bare": [[0.005, 0.005, 0.005], [0.010, 0.010, 0.010]]}
    cpu = {v: [[t / 2 for t in block] for block in blocks] for v, blocks in steps.items()}
    row = bench.summarise(2, "mlp", {"params": 10, "tensors": 2, "wall": steps, "cpu": cpu})
    assert row["round_median_ms"]["ddpkit"] == pytest.approx([11.0, 22.0])
    assert row["median_ms"]["torch"] == pytest.approx(15.0)  # median of all six steps
    ratio = row["ratios"]["ddpkit/torch"]
    assert ratio["rounds"] == pytest.approx([1.1, 1.1])
    assert (ratio["median"], ratio["min"], ratio["max"]) == pytest.approx((1.1, 1.1, 1.1))
    assert row["ratios"]["ddpkit/bare"]["median"] == pytest.approx(2.2)
    assert row["cpu_median_ms"]["torch"] == pytest.approx(7.5)
    assert row["cpu_ratios"]["ddpkit/torch"]["median"] == pytest.approx(1.1)


@pytest.mark.parametrize("bad", [{"steps": 0}, {"repeats": 0}, {"world_size": 0}, {"threads": 0},
                                 {"warmup": -1}, {"bucket_cap_mb": 0.0}, {"models": ("resnet",)},
                                 {"models": ()}, {"timeout_s": 0}])
def test_config_rejects_nonsense(bad):
    with pytest.raises(ValueError):
        bench.BenchConfig(**bad)


def test_world_sizes():
    assert bench.BenchConfig(world_size=3).world_sizes == [3, 1]
    assert bench.BenchConfig(world_size=3, single=False).world_sizes == [3]
    assert bench.BenchConfig(world_size=1).world_sizes == [1]


def test_bad_option_exits_with_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--steps", "0"])
    assert exc.value.code == 2
    assert "steps must be >= 1" in capsys.readouterr().err


def test_smoke_two_ranks_and_one(tmp_path, capsys):
    path = tmp_path / "bench.json"
    code = bench.main(["--world-size", "2", "--models", "many-small", "--steps", "2", "--warmup", "1",
                       "--repeats", "2", "--timeout", "240", "--quiet", "--json", str(path)])
    assert code == 0
    report = json.loads(path.read_text())
    rows = report["results"]
    assert [(r["world_size"], r["model"]) for r in rows] == [(2, "many-small"), (1, "many-small")]
    for row in rows:
        assert row["tensors"] == 500
        assert set(row["median_ms"]) == set(bench.VARIANTS)
        for variant in bench.VARIANTS:
            assert len(row["step_ms"][variant]) == 2 and all(len(block) == 2 for block in row["step_ms"][variant])
            assert math.isfinite(row["median_ms"][variant]) and row["median_ms"][variant] > 0
        assert set(row["ratios"]) == set(row["cpu_ratios"]) == {"ddpkit/torch", "ddpkit/bare"}
        for ratio in [*row["ratios"].values(), *row["cpu_ratios"].values()]:
            values = [ratio["median"], ratio["min"], ratio["max"], *ratio["rounds"]]
            assert all(math.isfinite(v) and v > 0 for v in values), ratio
            assert ratio["min"] <= ratio["median"] <= ratio["max"]
    out = capsys.readouterr().out
    assert "ddpkit/torch" in out and out.count("many-small") == 2


def test_smoke_inspector_and_timeline_on_against_off(tmp_path, capsys):
    path = tmp_path / "bench.json"
    code = bench.main(["--world-size", "2", "--no-single", "--models", "many-small", "--steps", "2", "--warmup",
                       "1", "--repeats", "2", "--timeout", "240", "--quiet", "--inspector", "--timeline", "--json",
                       str(path)])
    assert code == 0
    (row,) = json.loads(path.read_text())["results"]
    assert set(row["median_ms"]) == {*bench.VARIANTS, "inspected", "timeline"}
    for variant in ("inspected", "timeline"):
        ratio = row["cpu_ratios"][f"{variant}/ddpkit"]
        assert all(math.isfinite(v) and v > 0 for v in ratio["rounds"]), ratio
    out = capsys.readouterr().out
    assert "stall inspector on vs off" in out and "timeline on vs off" in out


def test_deadline_stops_every_rank(capsys):
    import multiprocessing

    code = bench.main(["--world-size", "2", "--models", "many-small", "--no-single", "--timeout", "0.5", "--quiet"])
    assert code == 1
    assert "deadline" in capsys.readouterr().err
    assert multiprocessing.active_children() == []


def test_cli_hands_bench_its_arguments(capsys):
    from ddpkit import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--help"])
    assert exit_info.value.code == 0
    assert "usage: ddpkit bench" in capsys.readouterr().out


def test_smoke_compiled_variants(tmp_path):
    """--compile: every variant torch.compile'd (aot_eager here: it compiles in seconds), interleaved as ever."""
    path = tmp_path / "bench.json"
    code = bench.main(["--world-size", "2", "--no-single", "--models", "mlp", "--steps", "2", "--warmup", "1",
                       "--repeats", "2", "--timeout", "240", "--quiet", "--compile", "aot_eager", "--json", str(path)])
    assert code == 0
    report = json.loads(path.read_text())
    assert report["environment"]["compile"] == "aot_eager" and report["config"]["compile"] == "aot_eager"
    (row,) = report["results"]
    assert set(row["median_ms"]) == set(bench.VARIANTS)
    assert all(math.isfinite(r) and r > 0 for r in row["ratios"]["ddpkit/torch"]["rounds"])


@pytest.mark.parametrize("bad", [{"compile": "no-such-backend"}, {"compile": "inductor", "warmup": 0}])
def test_compile_options_rejected(bad):
    with pytest.raises(ValueError, match="backend|warm-up"):
        bench.BenchConfig(**bad)


def test_bench_memory_figures_count_what_they_say():
    """bench --zero's peak: the high-water mark of live tensor bytes allocated inside the run; its gradient
    bytes: each storage once, however many .grad views it backs."""
    from ddpkit.bench_zero_memory import grad_bytes, peak_bytes

    mib = 1 << 20

    def step(held):
        scratch = torch.ones(2 * mib // 4)  # freed at the end of the step: counts only while it lives
        held.append(scratch[: mib // 4].clone())

    # build: 1 MiB; step 1: + 2 scratch + 1 kept (4), down to 2; step 2: + 2 + 1 = 5 MiB at the peak.
    peak = peak_bytes(lambda: [torch.zeros(mib // 4)], step, 2)
    assert 5 * mib <= peak <= 5 * mib + 4096, peak
    layer = nn.Linear(4, 4)
    flat = torch.zeros(20)
    layer.weight.grad, layer.bias.grad = flat[:16].view(4, 4), flat[16:]
    assert grad_bytes(layer) == 80
    layer.bias.grad = torch.zeros(4)
    assert grad_bytes(layer) == 96
