"""ddpkit.trainer.results: what an example script of Transformers calls after train() (log_metrics, save_metrics,
save_state, ...), giving what Transformers' Trainer gives, on rank 0 only."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from ddpkit.trainer.results import ResultsMixin, metrics_format
from ddpkit.trainer.trainer import Trainer
from helpers.models import Classifier, classification_data, trainer_args


def test_after_training_the_results_are_printed_and_written_as_transformers_does(tmp_path, local_world, capsys):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    trainer = Trainer(Classifier().double(), trainer_args(tmp_path, per_device_train_batch_size=4, max_steps=3),
                      train_dataset=classification_data(16))
    result = trainer.train()
    assert trainer.is_world_process_zero() and trainer.is_local_process_zero()
    assert trainer.get_num_trainable_parameters() == sum(p.numel() for p in Classifier().parameters())
    assert trainer.get_learning_rates() == [0.05, 0.05]  # decayed and not decayed groups, constant schedule
    # Transformers' get_optimizer_group: a parameter's group (by the parameter or its name), else every group's
    groups = trainer.optimizer.param_groups
    bias = trainer.model.net[0].bias
    assert trainer.get_optimizer_group(bias) is trainer.get_optimizer_group("net.0.bias") is groups[1]
    assert trainer.get_optimizer_group() == [group["params"] for group in groups]
    capsys.readouterr()
    trainer.log_metrics("train", result.metrics)
    ours = capsys.readouterr().out
    transformers.Trainer.log_metrics(SimpleNamespace(is_world_process_zero=lambda: True), "train", result.metrics)
    assert ours == capsys.readouterr().out and ours.startswith("***** train metrics *****\n  epoch")

    trainer.save_metrics("train", result.metrics)
    trainer.save_metrics("eval", {"eval_loss": 0.5, "epoch": 9.0})
    with open(tmp_path / "train_results.json") as f:
        assert json.load(f) == result.metrics
    with open(tmp_path / "all_results.json") as f:
        assert json.load(f) == {**result.metrics, "eval_loss": 0.5, "epoch": 9.0}
    os.remove(tmp_path / "trainer_state.json")  # written when training ended; save_state writes it again
    trainer.save_state()
    state = transformers.TrainerState.load_from_json(str(tmp_path / "trainer_state.json"))
    assert state.global_step == 3 and state.log_history == trainer.state.log_history


def test_metrics_are_formatted_by_transformers_rules_and_other_ranks_do_nothing(tmp_path, capsys):
    trainer_pt_utils = pytest.importorskip("transformers.trainer_pt_utils")
    metrics = {"train_runtime": 62.3456, "train_mem_cpu_alloc_delta": 3 << 20, "total_flos": 5 << 30,
               "train_loss": 0.123456789, "epoch": 2, "note": "x"}
    assert metrics_format(metrics) == trainer_pt_utils.metrics_format(metrics)
    assert metrics_format(metrics)["train_runtime"] == "0:01:02.34"

    other = ResultsMixin()
    other.world = SimpleNamespace(is_main=False, is_local_main=True)
    other.args = SimpleNamespace(output_dir=str(tmp_path / "out"))
    other.saves = SimpleNamespace(write_final_state=lambda state: None)  # rank 0's to write, as in Saves
    other.state = None
    other.log_metrics("train", metrics)
    other.save_metrics("train", metrics)
    other.save_state()
    assert capsys.readouterr().out == "" and not os.path.exists(tmp_path / "out")
    assert not other.is_world_process_zero() and other.is_local_process_zero()
    other.optimizer = None
    for call in (other.get_learning_rates, other.get_optimizer_group):
        with pytest.raises(ValueError, match="no optimizer yet"):
            call()


def test_a_script_reads_the_process_off_its_arguments_and_writes_a_model_card(tmp_path, local_world, monkeypatch):
    """What Transformers' example scripts read off TrainingArguments before any Trainer (they crashed on the first:
    should_log), and create_model_card, which they call where push_to_hub is False."""
    from ddpkit.args.process import ParallelMode

    args = trainer_args(tmp_path, per_device_train_batch_size=4, max_steps=2, eval_strategy="steps", eval_steps=2)
    assert (args.process_index, args.local_process_index, args.world_size, args.n_gpu) == (0, 0, 1, 0)
    assert args.device == torch.device("cpu") and args.parallel_mode is ParallelMode.NOT_PARALLEL
    assert args.should_log and args.should_save and args.push_to_hub is False
    assert isinstance(args.get_process_log_level(), int)
    with args.main_process_first(desc="tokenizing"):  # a world of one: no process group is needed
        assert not torch.distributed.is_initialized()
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    assert (args.process_index, args.local_process_index, args.world_size) == (3, 1, 4)
    assert args.parallel_mode.value == "distributed" and not args.should_log and not args.should_save
    assert args.get_process_log_level() == 30  # WARNING on the processes that do not log
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name)

    trainer = Trainer(Classifier().double(), args, train_dataset=classification_data(16),
                      eval_dataset=classification_data(4))
    trainer.train()
    trainer.create_model_card(finetuned_from="tiny-base", tasks="text-classification", dataset="synthetic",
                              tags="test", license="mit")
    card = (tmp_path / "README.md").read_text()
    assert card.startswith('---\nlibrary_name: "ddpkit"\nbase_model: "tiny-base"\nlicense: "mit"\n')
    assert 'tags: ["ddpkit", "test"]' in card and 'pipeline_tag: "text-classification"' in card
    assert "trained with ddpkit's Trainer, from tiny-base, on synthetic." in card
    assert "- total_train_batch_size: 4" in card and "- training_steps: 2" in card
    eval_loss = next(e["eval_loss"] for e in reversed(trainer.state.log_history) if "eval_loss" in e)
    assert f"| 2 | eval_loss | {eval_loss:.4g} |" in card


class Counted(Trainer):
    """compute_loss_context_manager extended as a Transformers subclass extends it: a context of its own entered
    on super()'s ExitStack; it records whether the Trainer's autocast was on around it."""

    entered: list[bool] = []

    def compute_loss_context_manager(self):
        stack = super().compute_loss_context_manager()
        stack.enter_context(_Recorded(type(self).entered))
        return stack


class _Recorded:
    def __init__(self, into):
        self.into = into

    def __enter__(self):
        self.into.append(torch.is_autocast_enabled("cpu"))

    def __exit__(self, *exc):
        return False


def test_the_helpers_a_subclass_calls_are_transformers(tmp_path, local_world):
    """get_decay_parameter_names, get_optimizer_cls_and_kwargs, create_optimizer_and_scheduler, metrics_format,
    and compute_loss_context_manager (the autocast; an override is used in training and in prediction_step)."""
    transformers = pytest.importorskip("transformers")
    pt_utils = pytest.importorskip("transformers.trainer_pt_utils")  # its metrics_format: Transformers 5's method
    config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=3)
    model = transformers.BertForSequenceClassification(config)
    args = trainer_args(tmp_path, bf16=True, optim="adamw_torch", adam_beta1=0.8, max_steps=2,
                        per_device_train_batch_size=4)
    hf = transformers.TrainingArguments(output_dir=str(tmp_path), adam_beta1=0.8, use_cpu=True, report_to=[],
                                        learning_rate=args.learning_rate, optim="adamw_torch")
    trainer = Counted(Classifier().double(), args, train_dataset=classification_data(8))
    small = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0,
                                    eos_token_id=0)
    gpt2 = transformers.GPT2LMHeadModel(small)  # its lm_head.weight is tied to the embedding
    for one in (model, gpt2):
        assert trainer.get_decay_parameter_names(one) == transformers.Trainer.get_decay_parameter_names(None, one)
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    assert (cls, kwargs) == transformers.Trainer.get_optimizer_cls_and_kwargs(hf, model)
    metrics = {"train_runtime": 3723.5, "train_loss": 0.123456789, "total_flos": 3e9, "epoch": 2}
    assert trainer.metrics_format(metrics) == pt_utils.metrics_format(metrics)  # takes no self there
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    assert trainer.optimizer is not None and trainer.lr_scheduler is not None
    trainer.lr_scheduler = None
    trainer.create_scheduler(num_training_steps=10, optimizer=trainer.optimizer)  # Transformers' keywords
    assert trainer.lr_scheduler is not None
    Counted.entered.clear()
    trainer.train()  # 2 steps of one micro-batch each, each inside the Trainer's bf16 autocast
    trainer.predict(classification_data(8))  # one batch of 8
    assert Counted.entered == [True, True, True]


def test_a_subclass_s_own_prediction_step_runs_under_the_autocast(tmp_path, local_world):
    """As a Seq2Seq-style override does: the model called under compute_loss_context_manager gets bf16, as
    Transformers' accelerate-wrapped forward does."""
    seen = []

    class Own(Trainer):
        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            inputs = self._prepare_inputs(inputs)
            with torch.no_grad(), self.compute_loss_context_manager():
                seen.append(torch.is_autocast_enabled("cpu"))
                outputs = model(**inputs)
            return outputs["loss"], outputs["logits"], inputs["labels"]

    Own(Classifier().double(), trainer_args(tmp_path, bf16=True)).predict(classification_data(4))
    assert seen == [True]

