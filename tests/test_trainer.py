"""The Trainer against single-process truth: accumulation, variable-length batches, uneven data, exact evaluation,
resuming (bitwise with the same world size, sample-exact with another), logs and the loss curve."""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import run_world

from ddpkit import integrity
from ddpkit.checkpoint import write_json
from ddpkit.args import TrainingArguments
from ddpkit.trainer import Trainer, write_loss_curve

# -- models and data ---------------------------------------------------------------------------------------------

class Classifier(nn.Module):
    def __init__(self, d_in=6, hidden=16, classes=3):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Dropout(0.2), nn.Linear(hidden, classes))

    def forward(self, x, labels=None, idx=None):
        logits = self.net(x)
        return {"loss": None if labels is None else F.cross_entropy(logits, labels), "logits": logits}


class Tagger(nn.Module):
    """Per-token classification: padding (label -100) changes nothing, so any batching gives the same sum."""

    def __init__(self, vocab=11, dim=8, classes=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, input_ids, labels):
        logits = self.head(torch.tanh(self.embed(input_ids)))
        return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100),
                "logits": logits}


def classification_data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return [{"x": x[i], "labels": y[i], "idx": torch.tensor(i)} for i in range(n)]


def token_data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(1, 9, (), generator=g))
        ids = torch.randint(1, 11, (length,), generator=g)
        out.append({"input_ids": ids, "labels": ids % 4})
    return out


def pad_collate(samples):
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    labels = torch.full((len(samples), longest), -100, dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, :len(s["input_ids"])] = s["input_ids"]
        labels[row, :len(s["labels"])] = s["labels"]
    return {"input_ids": ids, "labels": labels}


def _args(out, **kw):
    base = dict(output_dir=str(out), learning_rate=0.05, logging_steps=1, save_strategy="no", disable_tqdm=True,
                seed=7, ddp_timeout=60, lr_scheduler_type="constant")
    return TrainingArguments(**{**base, **kw})


def _params(model):
    """Parameters as numpy arrays: tensors cannot travel back from a rank through spawn's queue."""
    return [p.detach().cpu().numpy().copy() for p in model.parameters()]


def accuracy(pred):
    return {"accuracy": float((pred.predictions.argmax(-1) == pred.label_ids).mean()),
            "n": float(len(pred.label_ids))}


@pytest.fixture
def local_world():
    """In-process trainers make a world of one; tear it down so later forked ranks start clean."""
    import ddpkit

    yield
    ddpkit.destroy_process_group()


# -- equivalence with one process, uneven data, exact evaluation ------------------------------------------------

class FixedShards(torch.utils.data.Sampler):
    """Rank r reads exactly shards[r]: ranks with different numbers of batches."""

    def __init__(self, shards, rank):
        self.indices, self.epoch, self.consumed = shards[rank], 0, 0

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def state_dict(self):
        return {"epoch": self.epoch, "seed": 0, "consumed": self.consumed}

    def load_state_dict(self, state):
        self.epoch, self.consumed = state["epoch"], state["consumed"]


UNEVEN = ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 13])  # rank 1 runs out after the first step


def uneven_truth(data, args):
    """One process, by hand: per-device batch 2, accumulation 2, rank 0's 4 + rank 1's 4 samples, then 4, then 2."""
    torch.manual_seed(0)
    model = Classifier(hidden=16).double()
    model.net[2].p = 0.0
    opt = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                            eps=args.adam_epsilon, weight_decay=0.0)
    for step in ([0, 1, 2, 3, 10, 11, 12, 13], [4, 5, 6, 7], [8, 9]):
        x = torch.stack([data[i]["x"] for i in step])
        y = torch.stack([data[i]["labels"] for i in step])
        model(x, y)["loss"].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        opt.step()
        opt.zero_grad()
    return _params(model)


def equivalence_world(world, out, batch, accum, uneven):
    """Train the same things on this world; the caller compares a 2-rank world with a 1-rank one."""
    results = {}
    kw = dict(per_device_train_batch_size=batch, gradient_accumulation_steps=accum, max_steps=6, max_grad_norm=0.5)
    # 30 samples, 15 per rank: every epoch ends on a short window (3 samples per rank in 2 batches of 2 and 1).
    torch.manual_seed(0)
    model = Classifier().double()
    model.net[2].p = 0.0  # dropout masks would differ between 1 and 2 processes
    trainer = Trainer(model, _args(f"{out}/cls", **kw), classification_data(30))
    trainer.train()
    results["cls"] = (_params(model), [e["loss"] for e in trainer.state.log_history if "loss" in e])
    # Variable-length sequences: items (tokens) per rank and per micro-batch differ at every step.
    torch.manual_seed(0)
    model = Tagger().double()
    trainer = Trainer(model, _args(f"{out}/tok", **kw), token_data(30), data_collator=pad_collate)
    trainer.train()
    results["tok"] = (_params(model), [e["loss"] for e in trainer.state.log_history if "loss" in e])
    # Exact evaluation: 7 samples on 2 ranks (4 + 3), none counted twice.
    trainer = Trainer(model := Classifier().double(), _args(f"{out}/eval", per_device_eval_batch_size=2),
                      eval_dataset=classification_data(7, seed=3), compute_metrics=accuracy)
    metrics = trainer.evaluate()
    results["eval"] = {k: v for k, v in metrics.items() if "runtime" not in k and "per_second" not in k}
    if uneven:

        class UnevenTrainer(Trainer):
            def get_train_sampler(self):
                return FixedShards(UNEVEN, self.world.rank)

        torch.manual_seed(0)
        model = Classifier().double()
        model.net[2].p = 0.0
        args = _args(f"{out}/uneven", per_device_train_batch_size=2, gradient_accumulation_steps=2,
                     num_train_epochs=1, max_grad_norm=0.5)
        trainer = UnevenTrainer(model, args, classification_data(14))
        trainer.train()
        results["uneven"] = (_params(model), trainer.state.global_step, uneven_truth(classification_data(14), args))
    return results


def test_two_ranks_with_accumulation_equal_one_process_on_the_global_batch(tmp_path):
    b, a = 2, 3
    two = run_world(equivalence_world, 2, args=(str(tmp_path / "two"), b, a, True), deadline_s=150)
    (one,) = run_world(equivalence_world, 1, args=(str(tmp_path / "one"), 2 * a * b, 1, False), deadline_s=150)
    for name in ("cls", "tok"):
        (p0, losses0), (p1, _) = two[0][name], two[1][name]
        truth, truth_losses = one[name]
        assert len(losses0) == len(truth_losses) == 6
        for x, y, t in zip(p0, p1, truth):
            np.testing.assert_array_equal(x, y, err_msg=f"{name}: replicas diverged")
            np.testing.assert_allclose(x, t, rtol=1e-9, atol=1e-10, err_msg=f"{name}: not the single-process result")
        assert losses0 == pytest.approx(truth_losses, rel=1e-10, abs=1e-12), name
    for rank in (0, 1):
        assert two[rank]["eval"]["eval_n"] == 7.0
        assert two[rank]["eval"] == pytest.approx(one["eval"], rel=1e-12)
    # Uneven shards: 5 batches on rank 0, 2 on rank 1; the run finishes and equals one process by hand.
    (u0, steps0, truth), (u1, steps1, _) = two[0]["uneven"], two[1]["uneven"]
    assert steps0 == steps1 == 3
    for x, y, t in zip(u0, u1, truth):
        np.testing.assert_array_equal(x, y)
        np.testing.assert_allclose(x, t, rtol=1e-9, atol=1e-10)


# -- resuming ------------------------------------------------------------------------------------------------------

class Recorder(Trainer):
    """Notes (step about to be taken, epoch, sample ids) for every training micro-batch."""

    seen: list

    def get_train_sampler(self):
        self.seen = []
        self.sampler = super().get_train_sampler()
        return self.sampler

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training:
            self.seen.append((self.state.global_step + 1, self.sampler.epoch, inputs["idx"].tolist()))
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def _resumable_run(out_dir, resume=None, max_steps=8, n=26, save_steps=3, logging_steps=1):
    torch.manual_seed(0)
    model = Classifier().double()  # dropout on: the restored RNG must give the same masks
    args = _args(out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=max_steps,
                 save_strategy="steps", save_steps=save_steps, lr_scheduler_type="cosine", warmup_steps=2,
                 logging_steps=logging_steps)
    trainer = Recorder(model, args, classification_data(n))
    trainer.train(resume_from_checkpoint=resume)
    logs = [(e["step"], e["loss"], e["grad_norm"], e["learning_rate"]) for e in trainer.state.log_history
            if "loss" in e]
    return logs, _params(model), trainer.seen


def resume_same_world(world, out):
    full = _resumable_run(f"{out}/full")
    from3 = _resumable_run(f"{out}/from3", resume=f"{out}/full/checkpoint-3")  # mid epoch 0
    from6 = _resumable_run(f"{out}/from6", resume=f"{out}/full/checkpoint-6")  # mid epoch 1
    newest = _resumable_run(f"{out}/full", resume=True, max_steps=10)  # True: the newest, checkpoint-8
    # Logs every 4 steps, checkpoints at 3 and 6: each resume starts between two logs, and its first logged loss
    # must still cover the 4 steps the uninterrupted run's covers.
    sparse = [_resumable_run(f"{out}/sparse", logging_steps=4)]
    sparse += [_resumable_run(f"{out}/sparse{k}", resume=f"{out}/sparse/checkpoint-{k}", logging_steps=4)
               for k in (3, 6)]
    return full, from3, from6, newest, sorted(os.listdir(f"{out}/full/checkpoint-3")), sparse


def test_resume_with_the_same_world_size_is_bitwise(tmp_path):
    results = run_world(resume_same_world, 2, args=(str(tmp_path),), deadline_s=150)
    for full, from3, from6, newest, files, sparse in results:
        assert [entry[0] for entry in sparse[0][0]] == [4, 8]
        for resumed in sparse[1:]:
            assert resumed[0] == sparse[0][0], "a resumed run logged another loss than the uninterrupted one"
        logs, params, _ = full
        assert [entry[0] for entry in logs] == list(range(1, 9))
        for resumed in (from3, from6):
            assert resumed[0] == logs  # loss, grad norm and learning rate of every step, bit for bit
            for x, y in zip(resumed[1], params):
                np.testing.assert_array_equal(x, y)
        assert newest[0][:8] == logs and [entry[0] for entry in newest[0][8:]] == [9, 10]
        assert {seen[0] for seen in newest[2]} == {9, 10}
        assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "sampler_state.json", "trainer_state.json",
                "rng_state_0.pth", "rng_state_1.pth"} <= set(files)


def resume_across_worlds(world, out, resume, max_steps):
    _, _, seen = _resumable_run(f"{out}/w{world.world_size}", resume=resume, max_steps=max_steps, n=24,
                                save_steps=2)
    return seen


def _ids(seen, epoch, before=None, after=None):
    return [i for step, e, ids in seen if e == epoch and (before is None or step < before)
            and (after is None or step > after) for i in ids]


def test_resume_with_another_world_size_skips_and_repeats_nothing(tmp_path):
    out = str(tmp_path)
    # 24 samples; 2 ranks x batch 2 x accumulation 2 = 8 per step (3 steps an epoch), 1 rank: 4 (6 an epoch).
    two = run_world(resume_across_worlds, 2, args=(out, None, 12), deadline_s=120)
    (one,) = run_world(resume_across_worlds, 1, args=(out, f"{out}/w2/checkpoint-4", 12), deadline_s=120)
    again = run_world(resume_across_worlds, 2, args=(out, f"{out}/w1/checkpoint-10", 12), deadline_s=120)
    with open(f"{out}/w2/checkpoint-4/sampler_state.json") as f:
        assert json.load(f)["epoch"] == 1  # checkpoint-4 is one step into epoch 1: 8 of its samples done
    with open(f"{out}/w1/checkpoint-10/sampler_state.json") as f:
        assert json.load(f)["epoch"] == 2  # 4 steps of 4 finish epoch 1, 2 more are 8 samples into epoch 2
    seen_two = [entry for rank in two for entry in rank]
    seen_again = [entry for rank in again for entry in rank]
    epoch1 = _ids(seen_two, 1, before=5) + _ids(one, 1)
    epoch2 = _ids(one, 2, before=11) + _ids(seen_again, 2)
    assert sorted(epoch1) == list(range(24)), "epoch 1 across 2 -> 1 ranks"
    assert sorted(epoch2) == list(range(24)), "epoch 2 across 1 -> 2 ranks"
    assert {step for step, _, _ in one} == set(range(5, 13))
    assert {step for rank in again for step, _, _ in rank} == {11, 12}
    assert len(_ids(seen_again, 2)) == 16 and not _ids(seen_again, 3)


# -- the examples: the main job ------------------------------------------------------------------------------------

def example_world(world, name, argv):
    """An example's main() on this world (it leaves the process group when done, so one example per world)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    module = __import__(name)
    return module.main(argv)


def test_examples_train_on_two_processes(tmp_path):
    results = run_world(example_world, 2, deadline_s=150,
                        args=("train_digits", ["--output_dir", f"{tmp_path}/digits", "--disable_tqdm", "true"]))
    digits = results[0]
    chars = run_world(example_world, 2, deadline_s=120, args=("train_chars", [
        "--output_dir", f"{tmp_path}/chars", "--disable_tqdm", "--text_bytes", "30000", "--d_model", "32",
        "--max_steps", "12", "--logging_steps", "1", "--eval_steps", "6", "--gradient_checkpointing",
        "--per_device_train_batch_size", "4"]))[0]
    assert results[1]["eval_accuracy"] == digits["eval_accuracy"] >= 0.95
    files = set(os.listdir(tmp_path / "digits"))
    assert {"loss_curve.png", "metrics.jsonl", "trainer_state.json", "model.safetensors"} <= files
    assert any(name.startswith("checkpoint-") for name in files)
    with open(tmp_path / "chars" / "trainer_state.json") as f:
        losses = [e["loss"] for e in json.load(f)["log_history"] if "loss" in e]
    assert len(losses) == 12 and losses[-1] < losses[0]  # accumulation x gradient checkpointing x 2 ranks
    assert math.isfinite(chars["eval_loss"])


# -- one process: model outputs, logs, errors ------------------------------------------------------------------------

class Output:
    def __init__(self, loss, logits):
        self.loss, self.logits = loss, logits


class ObjectOutput(Classifier):
    def forward(self, x, labels=None, idx=None):
        out = super().forward(x, labels)
        return Output(out["loss"], out["logits"])


class TensorOutput(Classifier):
    def forward(self, x, labels=None, idx=None):
        return super().forward(x, labels)["loss"]


class LogitsOnly(Classifier):
    def forward(self, x, labels=None, idx=None):
        return super().forward(x, labels)["logits"]


class OwnLoss(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        logits = model(inputs["x"])
        loss = F.cross_entropy(logits, inputs["labels"])
        return (loss, {"logits": logits}) if return_outputs else loss


@pytest.mark.parametrize("model_cls,trainer_cls,bf16", [
    (Classifier, Trainer, False), (ObjectOutput, Trainer, False), (TensorOutput, Trainer, False),
    (LogitsOnly, OwnLoss, False), (Classifier, Trainer, True),
])
def test_every_kind_of_model_output_trains(model_cls, trainer_cls, bf16, tmp_path, local_world):
    torch.manual_seed(0)
    model = model_cls()
    data = [{k: v.float() if k == "x" else v for k, v in s.items()} for s in classification_data(40)]
    args = _args(tmp_path, max_steps=6, per_device_train_batch_size=8, bf16=bf16)
    trainer = trainer_cls(model, args, data, data[:10], compute_metrics=accuracy if model_cls is not
                          TensorOutput else None)
    out = trainer.train()
    assert out.global_step == 6 and math.isfinite(out.training_loss)
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"])
    if model_cls is not TensorOutput:
        assert metrics["eval_n"] == 10


def test_logs_state_metrics_and_loss_curve(tmp_path, local_world):
    import matplotlib.image

    from ddpkit.report import loss_curve_figure

    torch.manual_seed(0)
    args = _args(tmp_path, max_steps=9, logging_steps=2, per_device_train_batch_size=4, eval_strategy="steps",
                 eval_steps=3, save_strategy="steps", save_steps=2, save_total_limit=2, lr_scheduler_type="linear")
    trainer = Trainer(Classifier().double(), args, classification_data(20), classification_data(6, seed=1),
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
    trainer = Trainer(Classifier().double(), _args(tmp_path, max_steps=2), classification_data(8))
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


def test_trainer_errors_name_the_problem(tmp_path, local_world):
    from ddpkit.args import ArgumentError

    with pytest.raises(ArgumentError, match="gradient_checkpointing"):
        Trainer(Classifier(), _args(tmp_path, gradient_checkpointing=True), classification_data(8))
    trainer = Trainer(Classifier().double(), _args(tmp_path, max_steps=2), classification_data(8))
    with pytest.raises(ArgumentError, match="resume_from_checkpoint"):
        trainer.train(resume_from_checkpoint=True)
    with pytest.raises(ValueError, match="no scalar loss"):
        Trainer(LogitsOnly().double(), _args(tmp_path, max_steps=2), classification_data(8)).train()


def test_schedules_match_transformers():
    from ddpkit.trainer import get_scheduler

    def lrs(name):
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        sched = get_scheduler(name, opt, warmup_steps=2, total_steps=10)
        out = []
        for _ in range(11):
            out.append(sched.get_last_lr()[0])
            opt.step()
            sched.step()
        return out

    assert lrs("linear")[:4] == [0.0, 0.5, 1.0, 0.875] and lrs("linear")[10] == 0.0
    assert lrs("cosine")[2] == 1.0 and lrs("cosine")[6] == pytest.approx(0.5) and lrs("cosine")[10] == 0.0
    assert lrs("constant") == [1.0] * 11
    assert lrs("constant_with_warmup")[:3] == [0.0, 0.5, 1.0] and lrs("constant_with_warmup")[10] == 1.0


def test_report_to_tensorboard(tmp_path, local_world):
    args = _args(tmp_path, max_steps=2, report_to="tensorboard")
    trainer = Trainer(Classifier().double(), args, classification_data(8))
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


class ItemsAware(nn.Module):
    """Divides a summed loss by num_items_in_batch when it is given, as Transformers models do."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(6, 3)

    def forward(self, x, labels=None, num_items_in_batch=None):
        logits = self.net(x)
        if num_items_in_batch is None:
            return {"loss": F.cross_entropy(logits, labels), "logits": logits}
        return {"loss": F.cross_entropy(logits, labels, reduction="sum") / num_items_in_batch, "logits": logits}


class TupleTrainer(Trainer):
    """Batches are (x, labels) tuples: num_items_in_batch cannot reach the model's forward."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(inputs[0], inputs[1])
        return (outputs["loss"], outputs) if return_outputs else outputs["loss"]

    def count_items(self, batch):
        return len(batch[1])


def test_tuple_batches_with_an_items_aware_model_are_normalised(tmp_path, local_world):
    """Accumulating 4 micro-batches of 2 must give the loss and update of one batch of 8."""
    x, y = torch.randn(8, 6, generator=torch.Generator().manual_seed(0)), torch.arange(8) % 3
    data = list(zip(x, y))
    results = []
    for batch, accum in ((8, 1), (2, 4)):
        torch.manual_seed(0)
        model = ItemsAware()
        args = _args(tmp_path / f"b{batch}", per_device_train_batch_size=batch, gradient_accumulation_steps=accum,
                     max_steps=1, learning_rate=0.1, lr_scheduler_type="constant", warmup_steps=0,
                     max_grad_norm=0.0, weight_decay=0.0, logging_steps=1, save_strategy="no")
        trainer = TupleTrainer(model, args, train_dataset=data)
        trainer.train()
        results.append((trainer.state.log_history[0]["loss"], _params(model)))
    (loss_one, params_one), (loss_accum, params_accum) = results
    assert abs(loss_one - loss_accum) < 1e-6, (loss_one, loss_accum)
    for a, b in zip(params_one, params_accum):
        assert np.allclose(a, b, atol=1e-6)


def epochs_across_worlds(world, out, resume):
    torch.manual_seed(0)
    args = _args(f"{out}/w{world.world_size}", per_device_train_batch_size=2, gradient_accumulation_steps=2,
                 num_train_epochs=2, save_strategy="steps", save_steps=2)
    trainer = Recorder(Classifier().double(), args, classification_data(24))
    trainer.train(resume_from_checkpoint=resume)
    return trainer.seen, trainer.state.global_step


def test_training_by_epochs_resumed_on_another_world_size_covers_every_epoch(tmp_path):
    """2 ranks x 2 x 2 = 8 samples a step (6 steps for 2 epochs of 24); resumed on 1 rank (4 a step) after
    step 2, the run must still cover the rest of both epochs: 32 more samples, not the 4 steps the first
    plan had left."""
    out = str(tmp_path)
    two = run_world(epochs_across_worlds, 2, args=(out, None), deadline_s=120)
    assert two[0][1] == 6
    ((seen, last_step),) = run_world(epochs_across_worlds, 1, args=(out, f"{out}/w2/checkpoint-2"), deadline_s=120)
    assert last_step == 10
    first_part = [i for rank in two for step, epoch, ids in rank[0] if step <= 2 for i in ids]
    epoch0 = [i for step, epoch, ids in seen if epoch == 0 for i in ids] + first_part
    epoch1 = [i for step, epoch, ids in seen if epoch == 1 for i in ids]
    assert sorted(epoch0) == list(range(24)) and sorted(epoch1) == list(range(24))


def restarted_with_a_named_checkpoint(world, out):
    """The launcher restarted the job (TORCHELASTIC_RESTART_COUNT=1) whose arguments name an older checkpoint:
    it must continue from the newest one, not redo the steps since, and rotation must have kept the named one."""
    torch.manual_seed(0)
    args = _args(f"{out}/run", per_device_train_batch_size=2, max_steps=8, save_strategy="steps", save_steps=2,
                 save_total_limit=1, resume_from_checkpoint=f"{out}/run/checkpoint-2")
    trainer = Recorder(Classifier().double(), args, classification_data(24))
    trainer.train()
    return trainer.seen, trainer.world.restart


def first_run(world, out):
    args = _args(f"{out}/first", per_device_train_batch_size=2, max_steps=2, save_strategy="steps", save_steps=2)
    Trainer(Classifier().double(), args, classification_data(24)).train()


def test_a_restart_continues_from_the_newest_checkpoint(tmp_path):
    import shutil

    out = str(tmp_path)
    run_world(first_run, 2, args=(out,), deadline_s=120)
    # The first attempt of the job, resumed from run/checkpoint-2, got to checkpoint-6 before failing.
    os.makedirs(f"{out}/run")
    for step in (2, 6):
        shutil.copytree(f"{out}/first/checkpoint-2", f"{out}/run/checkpoint-{step}")
        with open(f"{out}/run/checkpoint-{step}/trainer_state.json") as f:
            state = json.load(f)
        state["global_step"] = step
        with open(f"{out}/run/checkpoint-{step}/trainer_state.json", "w") as f:
            json.dump(state, f)
        folder = f"{out}/run/checkpoint-{step}"  # a forged checkpoint needs a marker that matches its files
        names = [n for n in os.listdir(folder) if n != integrity.MARKER_FILE]
        write_json(os.path.join(folder, integrity.MARKER_FILE), integrity.manifest(folder, names, step))
    results = run_world(restarted_with_a_named_checkpoint, 2, args=(out,), deadline_s=120,
                        env={"TORCHELASTIC_RESTART_COUNT": "1"})
    for seen, restart in results:
        assert restart == 1
        assert min(step for step, _, _ in seen) == 7, "the restart went back before the newest checkpoint"
    # save_total_limit=1 rotated the others away, but never the checkpoint the arguments name
    kept = sorted(name for name in os.listdir(f"{out}/run") if name.startswith("checkpoint-"))
    assert kept == ["checkpoint-2", "checkpoint-8"], kept
