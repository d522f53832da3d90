"""What the Trainer reads of batches and models: the items a loss averages (Transformers' counting rule, shifted
labels for a causal LM) and whether a model takes num_items_in_batch, checked against Transformers' Trainer on a
GPT-2 whose forward takes **kwargs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from ddpkit.trainer import model_io
from helpers.models import params_of, trainer_args
from helpers.world import run_world


def test_items_are_the_labels_transformers_counts():
    labels = torch.tensor([[5, 6, 7, -100], [8, 9, -100, -100]])
    assert model_io.count_items({"labels": labels}) == 5
    assert model_io.count_items({"labels": labels}, shifted=True) == 3  # position 0 of a row is never a target
    shift = torch.tensor([[6, 7, -100, -100], [-100, -100, -100, -100]])
    assert model_io.count_items({"labels": labels, "shift_labels": shift}, shifted=True) == 2  # as given
    assert model_io.count_items({"x": torch.zeros(3, 2)}, shifted=True) == 3  # no labels: the samples


def test_loss_kwargs_and_shifted_labels_are_read_off_the_model():
    class Plain(nn.Module):
        def forward(self, x, labels=None):
            return x

    class Keywords(Plain):
        def forward(self, x, labels=None, **kwargs):
            return x

    class Named(Plain):
        def forward(self, x, labels=None, num_items_in_batch=None):
            return x

    class Refuses(Keywords):
        accepts_loss_kwargs = False

    class PreTrainedModel(nn.Module):  # stands for Transformers' base class, known by its name
        pass

    class Transformers(PreTrainedModel, Keywords):  # a BertForSequenceClassification: **kwargs, a mean loss
        pass

    def ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch=None):  # noqa: N802 - Transformers' name
        return logits

    class Hands(PreTrainedModel):  # a GPT2LMHeadModel: its **kwargs go to the loss, which divides by the count
        loss_function = staticmethod(ForCausalLMLoss)

        def forward(self, x, labels=None, **rest):
            return self.loss_function(x, labels, vocab_size=3, **rest)

    class Ignores(Hands):  # a CTC head: its **kwargs go to a loss that takes no count
        loss_function = staticmethod(lambda logits, labels, vocab_size, **kwargs: logits)

    class Keeps(PreTrainedModel):  # a LlamaForSequenceClassification: loss_function without the **kwargs
        def forward(self, x, labels=None, **kwargs):
            return self.loss_function(logits=x, labels=labels, config=None)

    # A **kwargs is no sign the loss divides by the count (it may drop it): only one handed on to the loss is
    assert [model_io.accepts_loss_kwargs(m()) for m in (Plain, Keywords, Named, Refuses, Transformers, Hands,
                                                        Keeps, Ignores)] == [False, False, True, False, False, True,
                                                                             False, False]
    causal, encoder_decoder = Plain(), Plain()
    causal.loss_type = encoder_decoder.loss_type = "ForCausalLM"
    encoder_decoder.config = type("Config", (), {"is_encoder_decoder": True})()
    assert [model_io.loss_shifts_labels(m) for m in (Plain(), causal, encoder_decoder)] == [False, True, False]

    class Peft(nn.Module):  # a PEFT model: forward(*args, **kwargs); its base model answers, as in Transformers
        def __init__(self, base):
            super().__init__()
            self.base = base

        def get_base_model(self):
            return self.base

        def forward(self, *args, **kwargs):
            return self.base(*args, **kwargs)

    assert model_io.accepts_loss_kwargs(Peft(Hands())) and model_io.loss_shifts_labels(Peft(causal))


LENGTHS = [3, 9, 2, 12, 5, 7, 4, 10]  # 52 labels, 44 of them after the first of each row
STEPS = dict(max_steps=2, learning_rate=1e-2, logging_steps=1, max_grad_norm=0.0, weight_decay=0.0,
             lr_scheduler_type="constant", seed=42)


def gpt2(loss_type):
    import transformers

    config = transformers.GPT2Config(vocab_size=50, n_positions=32, n_embd=16, n_layer=1, n_head=2, bos_token_id=0,
                                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).double()
    model.loss_type = loss_type  # None: GPT2LMHeadModel's own; "ForCausalLM": a Llama's, whose labels shift
    return model


def sequences():
    g = torch.Generator().manual_seed(3)
    return [{"input_ids": torch.randint(0, 50, (n,), generator=g)} for n in LENGTHS]


def collate(samples):
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    labels, mask = torch.full_like(ids, -100), torch.zeros_like(ids)
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[row, :n], labels[row, :n], mask[row, :n] = s["input_ids"], s["input_ids"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def gpt2_world(world, out, loss_type, batch, accum):
    from ddpkit.trainer.trainer import Trainer

    model = gpt2(loss_type)
    args = trainer_args(out, per_device_train_batch_size=batch, gradient_accumulation_steps=accum, **STEPS)
    trainer = Trainer(model, args, train_dataset=sequences(), data_collator=collate)
    trainer.train()
    return [e["loss"] for e in trainer.state.log_history if "loss" in e], params_of(model)


def transformers_run(out, loss_type):
    import transformers

    model = gpt2(loss_type)
    args = transformers.TrainingArguments(output_dir=str(out), report_to="none", use_cpu=True, disable_tqdm=True,
                                          per_device_train_batch_size=8, remove_unused_columns=False,
                                          save_strategy="no", **STEPS)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=sequences(), data_collator=collate)
    trainer.train()
    return [e["loss"] for e in trainer.state.log_history if "loss" in e], params_of(model)


@pytest.mark.parametrize("loss_type", [None, "ForCausalLM"])
def test_a_causal_lm_trains_as_in_transformers_however_the_global_batch_is_split(tmp_path, loss_type):
    """Before, ddpkit passed num_items_in_batch only to a forward naming it, so GPT-2 (**kwargs) got a per-batch
    mean times an unshifted count: step 1's loss was 3.9274595 for batch 8 x 1 and 3.9269952 for 1 x 8, where
    Transformers logs 3.3232348 for both (its count is 52 unshifted labels for GPT-2, 44 shifted for a Llama)."""
    pytest.importorskip("transformers")
    truth_losses, truth = transformers_run(tmp_path / "hf", loss_type)
    runs = [run_world(gpt2_world, 1, args=(str(tmp_path / f"one-{b}x{a}"), loss_type, b, a))[0]
            for b, a in ((8, 1), (1, 8))]
    runs += run_world(gpt2_world, 2, args=(str(tmp_path / "two"), loss_type, 2, 2))
    for losses, params in runs:
        assert losses == pytest.approx(truth_losses, rel=1e-6)  # Transformers upcasts the logits to float32
        for got, want in zip(params, truth):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_a_batch_encoding_is_counted_and_moved_as_a_mapping():
    """DataCollatorWithPadding returns a BatchEncoding, a Mapping that is not a dict: torch's pytree took it for a
    leaf, so a batch counted 1 sample (the epoch, the samples/s and a resume's position drifted) and its tensors
    stayed where they were (off the GPU). Its type is kept, as Transformers' Trainer keeps it."""
    from collections import UserDict

    transformers = pytest.importorskip("transformers")
    batch = transformers.BatchEncoding({"input_ids": torch.zeros(4, 6, dtype=torch.long), "labels": torch.ones(4)})
    assert model_io.batch_len(batch) == model_io.batch_len([batch]) == 4
    assert model_io.batch_len({"x": UserDict({"y": torch.zeros(3, 2)})}) == 3
    assert model_io.count_items(batch) == 4
    moved = model_io.to_device({"a": [batch], "b": (torch.zeros(2),)}, torch.device("meta"))
    assert type(moved["a"][0]) is transformers.BatchEncoding and moved["a"][0]["input_ids"].device.type == "meta"
    assert moved["b"][0].device.type == "meta"


def bert_world(world, out, batch, smoothing=0.0):
    import transformers

    from ddpkit.trainer.trainer import Trainer

    config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).double()
    g = torch.Generator().manual_seed(4)
    data = [{"input_ids": torch.randint(1, 40, (6,), generator=g), "labels": torch.tensor(i % 2)} for i in range(8)]
    args = trainer_args(out, per_device_train_batch_size=batch, label_smoothing_factor=smoothing,
                        **{**STEPS, "max_grad_norm": 1.0})
    trainer = Trainer(model, args, train_dataset=data)
    trainer.train()
    return [e["loss"] for e in trainer.state.log_history if "loss" in e], params_of(model)


def test_a_mean_loss_behind_transformers_kwargs_is_one_process_s_on_any_world_size(tmp_path):
    """BertForSequenceClassification takes **kwargs but returns a mean (CrossEntropyLoss()): read by Transformers'
    rule as a sum over the count, it trained 2 ranks x batch 4 on twice one process's loss and gradients (1.386
    against 0.693 logged; clipped at max_grad_norm accordingly)."""
    pytest.importorskip("transformers")
    (one,) = run_world(bert_world, 1, args=(str(tmp_path / "one"), 8))
    (smoothed,) = run_world(bert_world, 1, args=(str(tmp_path / "smoothed-one"), 8, 0.1))
    for losses, params in run_world(bert_world, 2, args=(str(tmp_path / "two"), 4)):
        assert losses == pytest.approx(one[0], rel=1e-9)
        for got, want in zip(params, one[1]):
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    # label_smoothing_factor (its loss divides by the global count): 2 ranks are one process too, to float32's
    # precision (the smoothing term sums in float32, as Transformers' LabelSmoother does).
    assert smoothed[0] != one[0]
    for losses, params in run_world(bert_world, 2, args=(str(tmp_path / "smoothed-two"), 4, 0.1)):
        assert losses == pytest.approx(smoothed[0], rel=1e-7)
        for got, want in zip(params, smoothed[1]):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)


def test_the_count_reaches_only_the_transformers_losses_that_divide_by_it():
    """A forward handing its **kwargs to loss_function is not enough: a ViT regression or multi-label head (MSE,
    BCE: means), a CTC head and a mixture of experts' router loss (a mean added) do not divide by the count; a
    single-label problem does only where the config names it (None is decided from the labels at the call)."""
    transformers = pytest.importorskip("transformers")
    small = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
    vit = dict(small, image_size=8, patch_size=4)
    single = "single_label_classification"
    found = [model_io.accepts_loss_kwargs(model) for model in (
        transformers.ViTForImageClassification(transformers.ViTConfig(**vit)),
        transformers.ViTForImageClassification(transformers.ViTConfig(**vit, problem_type=single)),
        transformers.ViTForImageClassification(transformers.ViTConfig(**vit, num_labels=1, problem_type="regression")),
        transformers.Wav2Vec2ForCTC(transformers.Wav2Vec2Config(**small, vocab_size=10, conv_dim=(8, 8),
                                                                conv_stride=(2, 2), conv_kernel=(3, 3),
                                                                num_conv_pos_embeddings=4,
                                                                num_conv_pos_embedding_groups=2)),
        transformers.MixtralForCausalLM(transformers.MixtralConfig(**small, vocab_size=30, num_key_value_heads=2,
                                                                   num_local_experts=2, output_router_logits=True)),
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**small, vocab_size=30)))]
    assert found == [False, True, False, False, False, True]


def test_label_smoothing_is_transformers_label_smoother_bit_for_bit():
    trainer_pt_utils = pytest.importorskip("transformers.trainer_pt_utils")
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(3, 7, 11, generator=g), torch.randint(0, 11, (3, 7), generator=g)
    labels[0, :3] = -100
    smoother = trainer_pt_utils.LabelSmoother(0.1)
    for shift in (False, True):
        for count in (None, torch.tensor(40.0)):
            assert torch.equal(model_io.smoothed_loss({"logits": logits}, labels, 0.1, shift, count),
                               smoother({"logits": logits}, labels, shift_labels=shift, num_items_in_batch=count))
    classes, targets = torch.randn(5, 4, generator=g), torch.tensor([0, 3, -100, 1, 2])  # a classifier's, a tuple
    assert torch.equal(model_io.smoothed_loss((classes,), targets, 0.2),
                       trainer_pt_utils.LabelSmoother(0.2)((classes,), targets))


def test_the_predictions_are_every_output_but_the_loss_as_transformers_prediction_step_takes_them():
    """Transformers: a mapping's values but "loss" and ignore_keys, a tuple's elements after the loss, one tensor
    where one is left (ddpkit took "logits" or the element after the loss alone)."""
    import transformers

    from ddpkit.trainer.model_io import ignored_at_inference, predictions_of

    loss, a, b = torch.tensor(1.0), torch.ones(2, 3), torch.zeros(2)
    assert predictions_of({"loss": loss, "logits": a}) is a
    start_end = predictions_of(transformers.modeling_outputs.QuestionAnsweringModelOutput(loss, a, b))
    assert start_end[0] is a and start_end[1] is b and len(start_end) == 2  # the Nones left out, as ModelOutput does
    assert predictions_of({"loss": loss, "output": a, "cache": b}, ignore_keys=["cache"]) is a
    assert predictions_of({"loss": None, "output": a, "norm": b}, with_loss=False) == (a, b)
    assert predictions_of((loss, a, b)) == (a, b) and predictions_of((a, b), with_loss=False) == (a, b)
    assert predictions_of(a, with_loss=False) is a
    with pytest.raises(ValueError, match="no predictions beside its loss"):
        predictions_of({"loss": loss, "logits": a}, ignore_keys=["logits"])
    config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=16)
    assert ignored_at_inference(transformers.BertForQuestionAnswering(config), None) == ["cache"]
    assert ignored_at_inference(nn.Linear(2, 2), None) == [] and ignored_at_inference(nn.Linear(2, 2), ["x"]) == ["x"]
