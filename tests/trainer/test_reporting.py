"""What the Trainer reports: log_history, trainer_state.json, metrics, the loss curve (with and without
matplotlib) and TensorBoard."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from ddpkit.trainer.trainer import Trainer, write_loss_curve
from helpers.models import Classifier, accuracy, classification_data, trainer_args


def test_logs_state_metrics_and_loss_curve(tmp_path, local_world):
    import matplotlib.image

    from ddpkit.trainer.reporting import loss_curve_figure

    torch.manual_seed(0)
    args = trainer_args(tmp_path, max_steps=9, logging_steps=2, per_device_train_batch_size=4, eval_strategy="steps",
                 eval_steps=3, save_strategy="steps", save_steps=2, save_total_limit=2, lr_scheduler_type="linear")
    trainer = Trainer(Classifier().double(), args, train_dataset=classification_data(20),
                      eval_dataset=classification_data(6, seed=1),
                      compute_metrics=accuracy)
    trainer.train()
    with open(tmp_path / "trainer_state.json") as f:
        state = json.load(f)
    assert state["global_step"] == 9 and state["max_steps"] == 9 and state["logging_steps"] == 2
    train_logs = [e for e in state["log_history"] if "loss" in e]
    assert [e["step"] for e in train_logs] == [2, 4, 6, 8, 9]
    assert {"loss", "grad_norm", "learning_rate", "epoch", "step", "samples_per_second"} <= set(train_logs[0])
    assert [e["step"] for e in state["log_history"] if "eval_loss" in e] == [3, 6, 9]
    assert "train_runtime" in state["log_history"][-1]
    with open(tmp_path / "metrics.jsonl") as f:
        assert [json.loads(line) for line in f] == state["log_history"]
    # save_total_limit=2 keeps the newest two; the final step (9) is saved too.
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("checkpoint-")) == ["checkpoint-8",
                                                                                      "checkpoint-9"]
    # The picture: loss (training and evaluation), the evaluation metrics, the learning rate, against the step.
    height, width, _ = matplotlib.image.imread(tmp_path / "loss_curve.png").shape
    assert (width, height) == (800, 880)  # 8 x 8.8 inches at 100 dpi: three panels
    loss_ax, metric_ax, lr_ax = loss_curve_figure(state["log_history"]).axes
    legend = {ax: [t.get_text() for t in ax.get_legend().get_texts()] for ax in (loss_ax, metric_ax, lr_ax)}
    assert legend == {loss_ax: ["training loss", "evaluation loss"], metric_ax: ["accuracy", "n"],
                      lr_ax: ["learning rate"]}
    assert [ax.get_ylabel() for ax in (loss_ax, metric_ax, lr_ax)] == ["loss", "evaluation metric", "learning rate"]
    assert lr_ax.get_xlabel() == "step"
    train_line, eval_line = loss_ax.get_lines()
    assert list(train_line.get_xdata()) == [2, 4, 6, 8, 9]  # the final summary's mean train_loss is no point
    assert list(train_line.get_ydata()) == [e["loss"] for e in train_logs]
    assert list(eval_line.get_xdata()) == [3, 6, 9]
    (lr_line,) = lr_ax.get_lines()
    assert list(lr_line.get_ydata()) == [e["learning_rate"] for e in train_logs]
    assert lr_line.get_ydata()[0] > lr_line.get_ydata()[-1]  # the linear decay


def test_without_matplotlib_one_line_says_how_to_get_the_plot(tmp_path, local_world, monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    trainer = Trainer(Classifier().double(), trainer_args(tmp_path, max_steps=2), train_dataset=classification_data(8))
    assert trainer.train().global_step == 2
    lines = capsys.readouterr().err.splitlines()
    assert [line for line in lines if "matplotlib" in line] == [
        "ddpkit: loss_curve.png not drawn: it needs matplotlib (pip install 'ddpkit[examples]', or pip install "
        "matplotlib)"]
    assert not (tmp_path / "loss_curve.png").exists()
    assert (tmp_path / "trainer_state.json").exists() and (tmp_path / "metrics.jsonl").exists()
    assert write_loss_curve(str(tmp_path / "one.png"), [{"loss": 2.0, "step": 1}]) is False


def test_a_single_logged_step_draws(tmp_path):
    assert write_loss_curve(str(tmp_path / "one.png"), [{"loss": 2.0, "learning_rate": 0.1, "step": 1,
                                                         "epoch": 0.5}])
    assert (tmp_path / "one.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_to_tensorboard(tmp_path, local_world):
    args = trainer_args(tmp_path, max_steps=2, report_to="tensorboard")
    trainer = Trainer(Classifier().double(), args, train_dataset=classification_data(8))
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.warns(RuntimeWarning, match="tensorboard"):
            trainer.train()
        assert os.path.exists(tmp_path / "metrics.jsonl")
    else:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        trainer.train()
        events = EventAccumulator(str(tmp_path / "runs"))
        events.Reload()
        assert [e.step for e in events.Scalars("train/loss")] == [1, 2]
        assert "train/learning_rate" in events.Tags()["scalars"]


def test_metrics_jsonl_reads_as_the_runs_log_after_a_resume_and_keeps_other_runs(tmp_path):
    from ddpkit.trainer.reporting import METRICS_FILE, Reporter

    out = str(tmp_path)
    path = os.path.join(out, METRICS_FILE)
    steps = [{"loss": 1.0 / s, "epoch": s / 10, "step": s} for s in range(1, 7)]
    first = Reporter(out, [], is_main=True)
    first.open([])
    for entry in steps:
        first.write(entry)
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"loss": 0.1, "ep')  # a line cut short by a kill
    # Resumed from step 3 of that run: its file must hold steps 1-3 only, the resume logging 4-6 again.
    Reporter(out, [], is_main=True).open(steps[:3], continues=True)
    with open(path, encoding="utf-8") as f:
        assert [json.loads(line) for line in f] == steps[:3]
    assert os.listdir(out) == [METRICS_FILE]
    # A fresh run (no history), or a history this file does not begin with: the file is kept aside, whole.
    Reporter(out, [], is_main=True).open([])
    assert open(path, encoding="utf-8").read() == ""
    with open(f"{path}.1", encoding="utf-8") as f:
        assert [json.loads(line) for line in f] == steps[:3]
    Reporter(out, [], is_main=True).open([{"loss": 9.0, "epoch": 0.1, "step": 1}])
    assert sorted(os.listdir(out)) == [METRICS_FILE, f"{METRICS_FILE}.1"]  # the empty file went unkept
    # A branch off an older point of the run (not continuing it): the file it leaves is kept whole too.
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"loss": 8.0, "step": 2}) + "\n")
    Reporter(out, [], is_main=True).open([{"loss": 9.0, "epoch": 0.1, "step": 1}], continues=False)
    with open(f"{path}.2", encoding="utf-8") as f:
        assert len(f.readlines()) == 2
    Reporter(out, [], is_main=False).open([])  # other ranks touch nothing
    assert os.path.getsize(path) > 0


_DIGITS = {"_runtime": 4, "_samples_per_second": 3, "_steps_per_second": 3}  # as Transformers' speed_metrics rounds


def _rounded(metrics):
    """The speed metrics among `metrics`, each with whether it is rounded as Transformers rounds it."""
    return {k: v == round(v, d) for k, v in metrics.items() for suffix, d in _DIGITS.items() if k.endswith(suffix)}


def test_speed_metrics_are_rounded_as_transformers_rounds_them(tmp_path, local_world, monkeypatch):
    """Transformers' speed_metrics rounds <split>_runtime to 4 decimals and the rates, from the unrounded runtime,
    to 3: train()'s final log, evaluate()'s and predict()'s metrics. ddpkit rounded none of them."""
    from transformers import trainer_utils

    from ddpkit.trainer.reporting import Progress

    # The summary against Transformers' own, both clocks 1.23456789 s past their start.
    monkeypatch.setattr(trainer_utils.time, "time", lambda: 101.23456789)
    theirs = trainer_utils.speed_metrics("train", 100.0, num_samples=21, num_steps=7)
    run = Progress(bar=None)
    for _ in range(7):
        run.step(3)
    run.clock.elapsed = lambda: 101.23456789 - 100.0
    assert {k: v for k, v in run.summary(0.5).items() if k in theirs} == theirs
    monkeypatch.undo()
    torch.manual_seed(0)
    args = trainer_args(tmp_path, max_steps=3, per_device_train_batch_size=4, eval_strategy="steps", eval_steps=3)
    trainer = Trainer(Classifier().double(), args, train_dataset=classification_data(20),
                      eval_dataset=classification_data(6, seed=1))
    output = trainer.train()
    train = dict.fromkeys(["train_runtime", "train_samples_per_second", "train_steps_per_second"], True)
    assert _rounded(output.metrics) == _rounded(trainer.state.log_history[-1]) == train
    evaluation = {k.replace("train", "eval"): True for k in train}
    assert _rounded(trainer.state.log_history[-2]) == _rounded(trainer.evaluate()) == evaluation
    test = {k.replace("train", "test"): True for k in train}
    assert _rounded(trainer.predict(classification_data(5, seed=2)).metrics) == test
