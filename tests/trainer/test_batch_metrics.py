"""ddpkit.trainer.batch_metrics: Transformers' batch_eval_metrics. compute_metrics at every evaluation step over that
step's batches of every rank, in dataset order, as tensors, compute_result at the last step only; the same
metrics as computed over every prediction at the end, on any world size; loaders that would leave a rank
waiting refused on every rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpkit.trainer.trainer import Trainer
from helpers.models import classification_data, trainer_args
from helpers.world import run_world


class Echo(nn.Module):
    """Logits whose first column is the sample's index: each call shows which samples it got, in which order."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(6, 3).double()

    def forward(self, x, labels=None, idx=None):
        logits = self.net(x)
        logits = torch.cat([idx.double().unsqueeze(1), logits[:, 1:]], dim=1)
        loss = None if labels is None else nn.functional.cross_entropy(self.net(x), labels)
        return {"loss": loss, "logits": logits}


class Accuracy:
    """A batch_eval_metrics compute_metrics as Transformers' documentation has them: it accumulates, and returns
    the metrics at the last step. Records each call: its samples, compute_result, the predictions' type."""

    def __init__(self):
        self.calls, self.right, self.seen = [], 0, 0

    def __call__(self, prediction, compute_result):
        logits, labels = prediction
        self.calls.append((logits[:, 0].long().tolist(), compute_result, type(logits).__name__))
        self.right += int((logits[:, 1:].argmax(-1) + 1 == labels).sum())
        self.seen += len(labels)
        if compute_result:  # the result, and a fresh start for the next evaluation
            result, self.right, self.seen = {"accuracy": self.right / self.seen, "samples": self.seen}, 0, 0
            return result


def at_the_end(prediction):
    logits, labels = prediction
    return {"accuracy": float(((logits[:, 1:].argmax(-1) + 1) == labels).mean()), "samples": len(labels)}


def batched_world(world, out, n):
    results = {}
    for batched in (True, False):
        torch.manual_seed(0)
        metric = Accuracy() if batched else at_the_end
        args = trainer_args(f"{out}/{batched}", per_device_eval_batch_size=2, batch_eval_metrics=batched,
                            remove_unused_columns=False)
        trainer = Trainer(Echo(), args, compute_metrics=metric)
        metrics = trainer.evaluate(classification_data(n))
        predicted = trainer.predict(classification_data(n + 3, seed=1))  # another set, after the first
        results[batched] = {k: v for k, v in metrics.items() if k in ("eval_accuracy", "eval_samples", "eval_loss")}
        results[batched]["test"] = {k: v for k, v in predicted.metrics.items()
                                    if k in ("test_accuracy", "test_samples", "test_loss")}
        results[batched]["order"] = predicted.predictions[:, 0].astype(int).tolist()
        if batched:
            results["calls"] = metric.calls
    return results


@pytest.mark.parametrize("world_size, n", [(2, 9), (3, 9), (1, 5)])
def test_each_step_gets_its_batches_in_dataset_order_and_the_metrics_match_the_end(tmp_path, world_size, n):
    outcome = run_world(batched_world, world_size, args=(str(tmp_path), n), deadline_s=120)
    step = 2 * world_size  # samples a step holds: one batch of 2 on every rank
    for results in outcome:
        calls = results["calls"]
        # evaluate's steps, then predict's: the step's samples in dataset order, compute_result at the last only
        steps = -(-n // step)
        assert len(calls) == steps + -(-(n + 3) // step), calls
        for run, size in ((calls[:steps], n), (calls[steps:], n + 3)):
            assert [c[0] for c in run] == [list(range(s, min(s + step, size))) for s in range(0, size, step)], run
            assert [c[1] for c in run] == [False] * (len(run) - 1) + [True] and {c[2] for c in run} == {"Tensor"}
        assert results[True] == results[False] and results[True]["eval_samples"] == n
        assert results[True]["test"]["test_samples"] == n + 3
        assert results[True]["order"] == list(range(n + 3))  # predict still returns every prediction, in order
    assert all(r == outcome[0] for r in outcome)


def other_loaders_world(world, out):
    """Rank 1's loader overridden: its own samples one at a time (4 batches where 2 were dealt), then the whole
    set; rank 0's is ddpkit's, and would wait at a step rank 1 never reaches (or that rank 0 never reaches)."""
    told = []
    for make in (lambda d, dealt: torch.utils.data.Subset(d, list(dealt.sampler)), lambda d, dealt: d):
        class Other(Trainer):
            def get_eval_dataloader(self, eval_dataset=None):
                loader = super().get_eval_dataloader(eval_dataset)
                if self.world.rank == 1:
                    return torch.utils.data.DataLoader(make(eval_dataset, loader), batch_size=1,
                                                       collate_fn=loader.collate_fn)
                return loader

        args = trainer_args(out, per_device_eval_batch_size=2, batch_eval_metrics=True, remove_unused_columns=False)
        told.append(_refusal(Other(Echo(), args, compute_metrics=Accuracy()), classification_data(8)))
    return told


def _refusal(trainer, data):
    """The ValueError evaluate(data) raises, as text."""
    with pytest.raises(ValueError) as raised:
        trainer.evaluate(data)
    return str(raised.value)


def test_a_loader_with_other_batches_is_refused_on_every_rank_before_any_step(tmp_path):
    for count, other in run_world(other_loaders_world, 2, args=(str(tmp_path),), deadline_s=60):
        assert "rank 1's loader has 4 batches, not the 2 batches ddpkit dealt it" in count, count
        assert "rank 1's loader reads other samples than the 2 batches ddpkit dealt it" in other, other
        assert "keep super()'s sampler" in count and "keep super()'s sampler" in other


class Unsized:
    """A loader without a length (a wrapper): only the count at the end can tell that it stopped early."""

    def __init__(self, loader, batches):
        self.loader, self.batches = loader, batches

    def __iter__(self):
        return iter(list(self.loader)[:self.batches])


def uncounted_world(world, out):
    """Rank 1's unsized loader stops after one of its two batches; then a set whose last batches have no labels."""
    class Short(Trainer):
        def get_eval_dataloader(self, eval_dataset=None):
            loader = super().get_eval_dataloader(eval_dataset)
            return Unsized(loader, 1) if self.world.rank == 1 and len(eval_dataset) == 8 else loader

    args = trainer_args(out, per_device_eval_batch_size=2, batch_eval_metrics=True, remove_unused_columns=False)
    trainer = Short(Echo(), args, compute_metrics=Accuracy())
    unlabelled = [dict(s, labels=None) if i >= 6 else s for i, s in enumerate(classification_data(10))]
    return [_refusal(trainer, data) for data in
            (classification_data(8), [{k: v for k, v in s.items() if v is not None} for s in unlabelled])]


def test_a_rank_short_of_batches_or_labels_that_stop_are_refused_on_every_rank(tmp_path):
    for short, mixed in run_world(uncounted_world, 2, args=(str(tmp_path),), deadline_s=60):
        assert "rank 1 predicted 2 samples, not the 4 ddpkit dealt it" in short, short
        assert "some batches of the dataset have labels and some do not" in mixed, mixed


def test_compute_metrics_without_compute_result_is_refused(tmp_path, local_world):
    args = trainer_args(tmp_path, batch_eval_metrics=True)
    with pytest.raises(ValueError, match="give your compute_metrics a compute_result argument"):
        Trainer(Echo(), args, compute_metrics=at_the_end)
    Trainer(Echo(), args)  # no compute_metrics: nothing to call
    Trainer(Echo(), trainer_args(tmp_path), compute_metrics=at_the_end)  # off: the end's signature
