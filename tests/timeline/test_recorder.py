"""The timeline: the summary's arithmetic on hand-made traces (pure), the request's plumbing (launcher, env,
arguments, CLI), then real worlds: a hand-written loop with a sleeping rank, and `ddpkit launch --timeline` on a
tiny Trainer script. No speed is asserted: only that the recorded phases account for the time that passed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddpkit import cli
from ddpkit.args.training_args import TrainingArguments
from ddpkit.errors import ArgumentError
from ddpkit.launch import launcher as launch
from ddpkit.distributed.variables import TIMELINE_VAR
from ddpkit.timeline import spec as timeline_spec
from ddpkit.timeline import summary as timeline_summary
from ddpkit.timeline.clock import best_offset
from ddpkit.timeline.recorder import Timeline, attach_timeline
from ddpkit.timeline.trace import build_trace
from helpers.traces import hand_trace, payload, x_event
from helpers.world import run_world

SLEEP_S = 0.05


# -- intervals and the summary: pure ------------------------------------------------------------------------------

def test_interval_arithmetic():
    merged = timeline_summary.union([(5, 7), (0, 2), (1, 3), (9, 9), (6, 8)])
    assert merged == [(0, 3), (5, 8)]
    assert timeline_summary.subtract(merged, [(1, 2), (4, 6), (7, 10)]) == [(0, 1), (2, 3), (6, 7)]
    assert timeline_summary.clip(merged, 2, 6) == [(2, 3), (5, 6)]
    assert timeline_summary.length(merged) == 6


def test_summary_of_a_hand_made_trace():
    summary = timeline_summary.summarize(hand_trace())
    (step,) = summary["steps"]
    row = step["per_rank"]["0"]
    assert row["step_ms"] == pytest.approx(10)
    assert row["compute_ms"] == pytest.approx(7)  # forward 2 + backward 5 - wait 1 + optimizer 1
    assert row["comm_ms"] == pytest.approx(3.5)
    assert row["exposed_comm_ms"] == pytest.approx(1.5)  # the wait 7-8 and the blocking all-reduce 9-9.5
    assert row["overlap_pct"] == pytest.approx(100 * 2 / 3.5)
    assert row["optimizer_ms"] == pytest.approx(1)
    assert row["data_wait_ms"] == pytest.approx(1)
    assert row["untracked_ms"] == pytest.approx(0.5)  # 9.5-10
    assert row["bytes_sent"] == 1008
    assert row["compute_ms"] + row["exposed_comm_ms"] + row["data_wait_ms"] + row["untracked_ms"] == \
        pytest.approx(row["step_ms"])
    assert summary["total"]["mean"]["step_ms"] == pytest.approx(10)
    (bucket,) = summary["buckets"]
    assert (bucket["bucket"], bucket["last_rank"], bucket["times_last"]) == (0, 1, 1)
    assert bucket["late_ms"] == pytest.approx(2)
    assert summary["clock_error_ms"] == pytest.approx(0.1)
    text = timeline_summary.format_summary(summary)
    assert "bucket 0: rank 1 last in 1 of 1 launches, 2.00 ms late" in text
    assert "57.1%" in text  # the overlap


def test_concurrent_collectives_get_lanes_that_nest():
    ms = 1e-3
    events = [x_event("a", "collective", 0, 5 * ms, tid=1), x_event("b", "collective", 1 * ms, 4.5 * ms, tid=1),
              x_event("c", "collective", 6 * ms, 7 * ms, tid=1)]
    trace = build_trace({0: payload(0, events)}, 1, [1, 1])
    lanes = {e["name"]: e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert lanes == {"a": 1, "b": 2, "c": 1}
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert names == {0: "compute", 1: "communication", 2: "communication 2"}


def test_clock_offset_takes_the_fastest_round_trip():
    # (t0, remote, t1): the second trip is fastest; remote is 100 s ahead of its midpoint.
    offset, error = best_offset([(0.0, 105.0, 10.0), (20.0, 120.5, 21.0), (30.0, 133.0, 34.0)])
    assert offset == pytest.approx(100.0)
    assert error == pytest.approx(0.5)
    with pytest.raises(ValueError):
        best_offset([])


# -- the request (launcher, env, arguments, CLI), and files that cannot be written ----------------------------------

def test_steps_and_the_environment_variable(tmp_path, monkeypatch):
    assert timeline_spec.parse_steps("3:8") == (3, 8)
    for bad in ("8:3", "0:2", "3", "a:b", "3:8:9"):
        with pytest.raises(ValueError, match="A:B"):
            timeline_spec.parse_steps(bad)
    value = timeline_spec.encode(str(tmp_path / "t.json"), None)
    assert timeline_spec.request({TIMELINE_VAR: value}) == (str(tmp_path / "t.json"), (3, 8))
    assert timeline_spec.request({}) is None
    with pytest.raises(ValueError, match="does not exist"):
        timeline_spec.encode(str(tmp_path / "missing" / "t.json"), "1:2")
    with pytest.raises(ValueError, match=r"--timeline .* is a folder, not a file; .*--timeline .*timeline.json\)"):
        timeline_spec.encode(str(tmp_path), "1:2")  # it used to pass, and crash the run after the window
    monkeypatch.setattr(os, "access", lambda *a, **k: False)  # someone else's folder (the tests may run as root)
    with pytest.raises(ValueError, match="may not write in"):
        timeline_spec.encode(str(tmp_path / "t.json"), None)
    with pytest.raises(ValueError, match="not what ddpkit launch"):
        timeline_spec.decode("t.json")
    assert timeline_spec.summary_path("/x/t.json") == "/x/t.summary.json"


def _launch_args(*argv):
    return cli.build_parser().parse_args(["launch", *argv, "train.py"])


def test_launch_flag_hands_the_request_to_the_workers(tmp_path):
    trace = str(tmp_path / "t.json")
    plan = launch.plan_launch(_launch_args("--timeline", trace, "--timeline-steps", "2:4"), environ={})
    assert timeline_spec.request(plan.worker_env) == (trace, (2, 4))
    assert TIMELINE_VAR not in launch.plan_launch(_launch_args(), environ={}).worker_env
    with pytest.raises(ValueError, match="needs --timeline"):
        launch.plan_launch(_launch_args("--timeline-steps", "2:4"), environ={})
    with pytest.raises(ValueError, match="A:B"):
        launch.plan_launch(_launch_args("--timeline", trace, "--timeline-steps", "4:2"), environ={})
    with pytest.raises(ValueError, match="is a folder"):
        launch.plan_launch(_launch_args("--timeline", str(tmp_path)), environ={})


def test_training_argument(tmp_path):
    assert TrainingArguments(output_dir=str(tmp_path), ddp_timeline_steps="3:8").ddp_timeline_steps == "3:8"
    for bad in ("8:3", "0:1", "x", 3):  # 3: not "A:B" (an int raised AttributeError on .split)
        with pytest.raises(ArgumentError, match="ddp_timeline_steps"):
            TrainingArguments(output_dir=str(tmp_path), ddp_timeline_steps=bad)
    (tmp_path / "timeline.json").mkdir()  # where the Trainer writes: refused on every rank, before any collective
    with pytest.raises(ArgumentError, match="ddp_timeline_steps: .*timeline.json' is a folder.*output_dir"):
        attach_timeline(argparse.Namespace(observers=[], active=True, rank=0, world_size=1), "3:8", str(tmp_path))


def test_a_trace_that_cannot_be_written_warns_and_training_goes_on(tmp_path):
    (tmp_path / "t.json").mkdir()  # became a folder after the launcher checked it
    timeline, param = Timeline(0, 1, (1, 2), str(tmp_path / "t.json")), torch.nn.Parameter(torch.zeros(1))
    param.grad, opt = torch.ones(1), torch.optim.SGD([param], lr=1.0)  # SGD keeps the gradient between steps
    timeline.watch_optimizers()  # global hooks: step 2's flush removes them before it writes, so none can leak
    with pytest.warns(RuntimeWarning, match="could not write .*t.json \\(Is a directory\\)") as warned:
        for _ in range(4):
            opt.step()
    assert param.item() == -4.0 and len([w for w in warned if "timeline" in str(w.message)]) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # no t.json.tmpPID left beside it


class _GoneStore:
    """A store whose host died: every call fails, as TCPStore's do then."""

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise dist.DistNetworkError("Connection reset by peer")
        return fail


@pytest.mark.parametrize("rank", [0, 1])
def test_a_store_that_fails_at_the_merge_costs_the_trace_not_the_step(tmp_path, rank):
    timeline = Timeline(rank, 2, (1, 1), str(tmp_path / "t.json"), store=_GoneStore(), prefix="p/")
    param = torch.nn.Parameter(torch.zeros(1))
    param.grad, opt = torch.ones(1), torch.optim.SGD([param], lr=1.0)
    timeline.watch_optimizers()
    with pytest.warns(RuntimeWarning, match="could not meet in the store .*Connection reset by peer"):
        for _ in range(3):
            opt.step()  # step 1's end flushes from inside the optimizer hook
    assert param.item() == -3.0 and timeline.done
    written = json.loads((tmp_path / "t.json").read_text()) if rank == 0 else None
    assert (tmp_path / "t.json").exists() == (rank == 0)
    assert written is None or {e.get("pid") for e in written["traceEvents"] if e.get("ph") == "X"} == {0}


@pytest.mark.parametrize("window, taken, says", [((1000, 1010), 23, "23, before step 1000: the window was never "
                                                  "reached"), ((3, 8), 5, "5, before step 8: steps 3 to 5")])
def test_a_run_that_ends_before_the_window_says_so(tmp_path, capsys, window, taken, says):
    timeline = Timeline(0, 1, window, str(tmp_path / "t.json"))
    for _ in range(taken):
        timeline.step_done()
    timeline.close()  # as destroy_process_group does, before step B
    out = capsys.readouterr().out
    assert f"optimizer steps {window[0]} to {window[1]};" in out and f"run ended after optimizer step {says}" in out


# -- a real world: a hand-written loop, rank 1 sleeping in its backward -----------------------------------------------

def _loop(world, sleep_rank):
    import time

    import torch
    from torch import nn

    import ddpkit

    class WithLoss(nn.Sequential):  # the loss inside forward: a loop's every phase is then one the timeline sees
        def forward(self, x):
            return super().forward(x).square().mean()

    torch.manual_seed(0)
    model = WithLoss(*[nn.Linear(384, 384) for _ in range(6)])
    ddp = ddpkit.DistributedDataParallel(model, bucket_cap_mb=1.0)  # 0.56 MiB a layer: three buckets
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x = torch.randn(128, 384, generator=torch.Generator().manual_seed(world.rank))
    if world.rank == sleep_rank:  # the last layer's gradient comes first in backward: every bucket is late here
        model[-1].weight.register_hook(lambda grad: time.sleep(SLEEP_S) or grad)
    # When each optimizer step ends, by the loop's own clock: a per-optimizer hook runs just before the global one
    # that ends the timeline's step (and, after step 6, writes the trace).
    stepped = [time.perf_counter()]
    opt.register_step_post_hook(lambda *_: stepped.append(time.perf_counter()))
    for _ in range(7):
        opt.zero_grad(set_to_none=True)
        ddp(x).backward()
        opt.step()
    # After the window: the same names reach torch's profiler.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.zero_grad(set_to_none=True)
        ddp(x).backward()
        opt.step()
    profiled = sorted({e.name for e in prof.events()})
    timeline = ddp.reducer.recorder
    return {"summary": timeline.summary, "done": timeline.done, "buckets": len(ddp.bucket_plan),
            "during_backward": ddp.reducer.launched_during_backward, "stepped": stepped, "profiled": profiled}


def test_a_world_with_a_sleeping_rank(tmp_path):
    path = tmp_path / "t.json"
    results = run_world(_loop, 2, args=(1,), env={TIMELINE_VAR: timeline_spec.encode(str(path), "3:6")},
                        deadline_s=240)
    trace = json.loads(path.read_text())  # parses as JSON, in Chrome's object format
    events = trace["traceEvents"]
    assert trace["displayTimeUnit"] == "ms" and trace["otherData"]["ddpkit"]["ranks"] == [0, 1]
    for e in events:
        assert {"ph", "pid", "tid", "name"} <= set(e)
        assert e["ph"] == "M" or (e["ts"] >= 0 and e.get("dur", 0) >= 0)
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes == {0: "rank 0", 1: "rank 1"}
    assert all(r["done"] for r in results)
    buckets = results[0]["buckets"]
    assert buckets == 3 and all(r["during_backward"] == buckets for r in results)  # all launched in backward
    for rank in (0, 1):
        mine = [e for e in events if e["pid"] == rank and e["ph"] == "X"]
        assert sorted(e["args"]["step"] for e in mine if e["cat"] == "step") == [3, 4, 5, 6]
        for step in range(3, 7):  # every bucket's collective: launched (its copy-in) before it was done
            for b in range(buckets):
                (copy,) = [e for e in mine if e["cat"] == "copy" and e["args"]["bucket"] == b
                           and f"backward {step}" in _collective_of(mine, e)["name"]]
                done = _collective_of(mine, copy)
                assert copy["ts"] <= done["ts"] + done["dur"]
    summary = results[0]["summary"]
    assert summary == json.loads(Path(timeline_spec.summary_path(str(path))).read_text())
    _check_summary(summary, results)
    assert {"DistributedDataParallel.forward", "copy in bucket 0", "Optimizer.step#SGD.step"} <= \
        set(results[0]["profiled"])


def _collective_of(mine, copy):
    """The all-reduce a copy-in span launched: the first collective of its bucket issued from inside it."""
    end = copy["ts"] + copy["dur"]
    return next(e for e in sorted(mine, key=lambda e: e["ts"]) if e["cat"] == "collective"
                and e["args"]["what"].startswith(f"bucket {copy['args']['bucket']},") and copy["ts"] <= e["ts"] <= end)


def _check_summary(summary, results):
    total = summary["total"]["mean"]
    assert 0 < total["exposed_comm_ms"] < total["comm_ms"] and total["overlap_pct"] > 0
    first = summary["buckets"][0]
    assert first["bucket"] == 0 and first["last_rank"] == 1  # the sleeping rank
    # Named from the majority of the steps: on a CPU shared with other jobs, the other rank may lose a step now and
    # then; without the sleep either rank would be last, a few ms apart.
    assert first["launches"] == 4 and first["times_last"] >= 3 and first["late_ms"] > 0.5 * SLEEP_S * 1e3
    for rank, result in enumerate(results):
        measured = [1e3 * (b - a) for a, b in zip(result["stepped"], result["stepped"][1:])]
        accounted = wall = 0.0
        for step in summary["steps"]:
            row = step["per_rank"][str(rank)]
            parts = row["compute_ms"] + row["exposed_comm_ms"] + row["data_wait_ms"]
            step_wall = measured[step["step"] - 1]  # stepped[k] is when optimizer step k ended
            # Each step's parts, the untracked rest included, are the step the loop measured...
            assert abs(parts + row["untracked_ms"] - step_wall) <= 0.05 * step_wall, (rank, step["step"], row)
            assert row["bytes_sent"] >= 6 * 384 * 385 * 4  # every gradient, once
            accounted, wall = accounted + parts, wall + step_wall
        # ... and the recorded phases leave almost nothing out (a busy CPU may deschedule one between two phases).
        assert abs(accounted - wall) <= 0.05 * wall, (rank, accounted, wall)


# -- the launcher on a tiny Trainer script --------------------------------------------------------------------------

TRAINER_SCRIPT = """
import torch
import torch.distributed as dist
from torch import nn
import ddpkit
from ddpkit import Trainer, TrainingArguments

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
    def forward(self, x, labels=None):
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}

g = torch.Generator().manual_seed(0)
data = [{"x": torch.randn(8, generator=g), "labels": torch.tensor(i % 2)} for i in range(64)]
args = TrainingArguments(output_dir=OUT, max_steps=5, per_device_train_batch_size=4, save_strategy="no",
                         logging_steps=100, report_to=["none"], disable_tqdm=True, ddp_replica_check_steps=0)
Trainer(Net(), args, train_dataset=data).train()
ddpkit.destroy_process_group()
"""


def test_launch_writes_one_merged_trace(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(f"OUT = {str(tmp_path / 'out')!r}\n" + TRAINER_SCRIPT)
    trace_path = tmp_path / "t.json"
    run_env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "PET_"))}
    proc = subprocess.run([sys.executable, "-m", "ddpkit", "launch", "--nproc-per-node", "2", "--timeline",
                           str(trace_path), "--timeline-steps", "2:4", str(script)], env=run_env,
                          capture_output=True, text=True, timeout=240, start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    trace = json.loads(trace_path.read_text())
    events = trace["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    for rank in (0, 1):
        mine = [e for e in events if e["pid"] == rank and e["ph"] == "X"]
        assert sorted(e["args"]["step"] for e in mine if e["cat"] == "step") == [2, 3, 4]
        cats = {e["cat"] for e in mine}
        assert {"data", "forward", "backward", "copy", "optimizer", "collective", "wait"} <= cats
        # The Trainer's own agreement (one all-reduce per step) is on the communication track.
        assert any("items and batches" in e["name"] for e in mine if e["cat"] == "collective")
    assert "ddpkit timeline: 2 rank(s), optimizer steps 2 to 4" in proc.stdout
    summary = json.loads(Path(timeline_spec.summary_path(str(trace_path))).read_text())
    assert [s["step"] for s in summary["steps"]] == [2, 3, 4]
    assert cli.main(["timeline", str(trace_path)]) == 0


def _trainer_run(world, out):
    import torch
    from torch import nn

    from ddpkit import Trainer, TrainingArguments

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x, labels=None):
            logits = self.lin(x)
            return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}

    data = [{"x": torch.randn(4), "labels": torch.tensor(i % 2)} for i in range(32)]
    args = TrainingArguments(output_dir=out, max_steps=4, per_device_train_batch_size=4, eval_strategy="steps",
                             eval_steps=2, save_steps=2, logging_steps=100, disable_tqdm=True,
                             ddp_timeline_steps="3:3")
    trainer = Trainer(Net(), args, train_dataset=data, eval_dataset=data[:8])
    trainer.train()
    return trainer.timeline.summary


def test_trainer_records_its_own_phases(tmp_path):
    (summary,) = run_world(_trainer_run, 1, args=(str(tmp_path),), deadline_s=120)
    trace = json.loads((tmp_path / "timeline.json").read_text())
    cats = {e.get("cat") for e in trace["traceEvents"] if e["ph"] == "X"}
    # Step 3 began when step 2's optimizer step ended: the evaluation and checkpoint due at step 2 are in it.
    assert {"step", "data", "optimizer", "evaluation", "checkpoint"} <= cats
    assert [s["step"] for s in summary["steps"]] == [3]
    row = summary["steps"][0]["per_rank"]["0"]
    assert row["data_wait_ms"] > 0 and row["compute_ms"] > row["optimizer_ms"] > 0
