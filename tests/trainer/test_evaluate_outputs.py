"""ddpkit.trainer.evaluate: a model's several outputs are all predicted, every one but the loss, as Transformers'
prediction_step keeps them (a tuple's elements after the loss, a mapping's values but "loss" and ignore_keys),
gathered over the ranks element by element in dataset order, padded with -100 (split from test_trainer_eval)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ddpkit.trainer.trainer import Trainer
from helpers.models import Classifier, classification_data, trainer_args
from helpers.world import run_world


class TwoOutputs(torch.nn.Module):
    """Per-token logits and a per-token score: (loss, logits, scores) given labels, (logits, scores) without."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(11, 8), torch.nn.Linear(8, 4)

    def forward(self, input_ids, labels=None):
        logits = self.head(torch.tanh(self.embed(input_ids)))
        if labels is None:
            return logits, logits.amax(-1)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return loss, logits, logits.amax(-1)


class NoLogitsKey(Classifier):
    """A dict without "logits": {"loss", "output", "norm"} (and "hidden", which ignore_keys leaves out)."""

    def forward(self, x, labels=None, idx=None):
        out = super().forward(x, labels)
        found = {"output": out["logits"], "norm": out["logits"].norm(dim=-1), "hidden": x}
        return found if labels is None else {"loss": out["loss"], **found}


def multi_output_world(world, out):
    """predict and evaluate (compute_metrics, eval_do_concat_batches=False, batch_eval_metrics) of both models on
    9 samples in batches of 2 (ranks with 3 and 2 batches on 2 ranks); token sequences of lengths 1-8."""
    from helpers.models import pad_collate, token_data

    got, seen = {}, []

    def metric(prediction, compute_result=True):
        seen.append(tuple(np.asarray(p.cpu() if torch.is_tensor(p) else p).shape for p in prediction.predictions))
        return {"norm": float(sum(np.asarray(p.cpu() if torch.is_tensor(p) else p).sum()
                                  for p in prediction.predictions[1]))}

    def preprocess(logits, labels):
        seen.append(("preprocess", type(logits).__name__, len(logits)))
        return logits[0].argmax(-1), logits[1]

    torch.manual_seed(0)
    tuples = Trainer(TwoOutputs(), trainer_args(f"{out}/tuple", per_device_eval_batch_size=2),
                     data_collator=pad_collate)
    got["tuple"] = tuple(tuples.predict(token_data(9)))[:2]
    tuples.args.eval_do_concat_batches = False
    got["tuple steps"] = tuples.predict(token_data(9)).predictions
    tuples.args.eval_do_concat_batches, tuples.compute_metrics = True, metric
    tuples.preprocess_logits_for_metrics = preprocess
    got["preprocessed"] = tuples.predict(token_data(9)).predictions
    torch.manual_seed(0)
    dicts = Trainer(NoLogitsKey().double(), trainer_args(f"{out}/dict", per_device_eval_batch_size=2),
                    compute_metrics=metric)
    got["dict"] = tuple(dicts.predict(classification_data(9), ignore_keys=["hidden"]))[:2]
    got["dict metrics"] = dicts.evaluate(classification_data(9), ignore_keys=["hidden"])["eval_norm"]
    dicts.args.batch_eval_metrics = True
    got["dict batches"] = dicts.evaluate(classification_data(9), ignore_keys=["hidden"])["eval_norm"]
    got["seen"] = seen
    return got


def _transformers_predictions(tmp_path, model, data, **kwargs):
    import transformers

    args = transformers.TrainingArguments(str(tmp_path / "hf"), per_device_eval_batch_size=2, use_cpu=True,
                                          report_to="none")
    return transformers.Trainer(model=model, args=args, **kwargs).predict(data, ignore_keys=["hidden"])


def test_several_outputs_are_all_predicted_over_the_ranks_as_in_transformers(tmp_path):
    """Transformers' prediction_step keeps every output but the loss (and ignore_keys), its evaluation loop each
    padded with -100 and concatenated: a tuple of arrays. ddpkit kept one (a tuple's first, a dict's "logits": a
    KeyError for a dict without it), on any world size the same as one process."""
    from helpers.models import pad_collate, token_data

    torch.manual_seed(0)
    theirs = _transformers_predictions(tmp_path, TwoOutputs(), token_data(9), data_collator=pad_collate)
    torch.manual_seed(0)
    theirs_dict = _transformers_predictions(tmp_path, NoLogitsKey().double(), classification_data(9))
    assert isinstance(theirs.predictions, tuple) and len(theirs_dict.predictions) == 2
    results = [run_world(multi_output_world, n, args=(str(tmp_path / str(n)),), deadline_s=120) for n in (1, 2)]
    for got in [*results[0], *results[1]]:
        for mine, truth in ((got["tuple"], theirs), (got["dict"], theirs_dict)):
            assert isinstance(mine[0], tuple) and len(mine[0]) == 2
            for array, want in zip(mine[0], truth.predictions):
                np.testing.assert_allclose(array, want, rtol=1e-6, atol=1e-6)  # -100 padding where theirs has it
            np.testing.assert_array_equal(mine[1], truth.label_ids)
        steps = got["tuple steps"]  # one tuple per step, each element padded within the step
        assert isinstance(steps, list) and all(isinstance(s, tuple) and len(s) == 2 for s in steps)
        for i, want in enumerate(theirs.predictions):
            longest = want.shape[1]
            np.testing.assert_allclose(np.concatenate([np.pad(s[i], [(0, 0), (0, longest - s[i].shape[1])]
                                                              + [(0, 0)] * (s[i].ndim - 2), constant_values=-100)
                                                       for s in steps]), want, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(got["preprocessed"][0], np.where(theirs.predictions[1] == -100, -100,
                                                                       theirs.predictions[0].argmax(-1)))
        assert ("preprocess", "tuple", 2) in got["seen"] and {((9, 8), (9, 8)), ((9, 3), (9,))} <= set(got["seen"])
        norm = float(theirs_dict.predictions[1].sum())
        assert got["dict metrics"] == pytest.approx(norm, rel=1e-9)
        assert got["dict batches"] == pytest.approx(float(theirs_dict.predictions[1][-1]), rel=1e-9)  # last step
    for n in (1, 2):
        np.testing.assert_array_equal(results[n - 1][0]["tuple"][0][0], results[n - 1][-1]["tuple"][0][0])


class QuestionAnswers(torch.utils.data.Dataset):
    def __init__(self, n=9):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(5, 90, (n, 12), generator=g)
        self.starts = torch.randint(0, 6, (n,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "start_positions": self.starts[i], "end_positions": self.starts[i] + 2}


def tiny_qa():
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=37)
    return transformers.BertForQuestionAnswering(config)


def qa_world(world, out):
    found = Trainer(tiny_qa(), trainer_args(out, per_device_eval_batch_size=2)).predict(QuestionAnswers())
    return found.predictions, found.label_ids, found.metrics["test_loss"]


def test_a_question_answering_model_predicts_start_and_end_logits_as_in_transformers(tmp_path):
    """BertForQuestionAnswering returns start_logits and end_logits, no "logits" (ddpkit's predict raised a
    KeyError): predict gives (start_logits, end_logits), what run_qa.py post-processes, on 2 ranks too."""
    theirs = _transformers_predictions(tmp_path, tiny_qa(), QuestionAnswers())
    for n in (1, 2):
        for predictions, label_ids, loss in run_world(qa_world, n, args=(str(tmp_path / str(n)),), deadline_s=120):
            assert isinstance(predictions, tuple) and [p.shape for p in predictions] == [(9, 12), (9, 12)]
            for mine, want in zip(predictions, theirs.predictions):
                np.testing.assert_allclose(mine, want, rtol=1e-5, atol=1e-5)
            assert isinstance(label_ids, tuple) and len(label_ids) == 2
            np.testing.assert_array_equal(label_ids[1], label_ids[0] + 2)
            assert loss == pytest.approx(theirs.metrics["test_loss"], rel=1e-5)


class WithAux(Classifier):
    """A mixture of experts' outputs beside the logits: an auxiliary loss (one value a batch) and router logits
    (rows per token, not per sample)."""

    def forward(self, x, labels=None, idx=None):
        out = super().forward(x, labels)
        return {**out, "aux_loss": out["logits"].square().mean(), "router": out["logits"].repeat(3, 1)}


def test_outputs_without_a_row_per_sample_are_left_out_of_the_predictions(tmp_path, local_world):
    """They were refused ("outputs have [4, 1] rows"), which broke evaluate with compute_metrics and predict on
    such models (Transformers' Mixtral with output_router_logits): the per-sample logits are predicted."""
    torch.manual_seed(0)
    model = WithAux().double()
    trainer = Trainer(model, trainer_args(tmp_path, per_device_eval_batch_size=4),
                      compute_metrics=lambda p: {"rows": float(len(p.predictions))})
    data = classification_data(10)
    found = trainer.predict(data)
    want = model.eval()(torch.stack([s["x"] for s in data]))["logits"].detach().numpy()
    np.testing.assert_allclose(found.predictions, want, rtol=1e-12, atol=1e-12)
    assert trainer.evaluate(data)["eval_rows"] == 10.0
