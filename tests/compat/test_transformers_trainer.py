"""What a script that swaps Transformers' Trainer for ddpkit's sees alike: total_flos as Transformers 5 counts it (for
a Transformers model, 6 x the tokens of its main input x its parameters outside the embeddings, per micro-batch,
summed over the ranks, in each checkpoint's trainer_state.json, in the final log, and carried on by a resume;
ddpkit's stayed 0), save_model's folder, which from_pretrained loads, and a checkpoint's trainer_state.json, which
transformers.TrainerState.load_from_json loads."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ddpkit.trainer.trainer import Trainer
from helpers.models import Classifier, classification_data, trainer_args
from helpers.world import run_world


def gpt2():
    import transformers

    config = transformers.GPT2Config(vocab_size=50, n_positions=32, n_embd=16, n_layer=1, n_head=2, bos_token_id=0,
                                     eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def sequences(n=16):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 50, (n, 8), generator=g)]


def flos_world(world, out):
    """2 steps of 2 samples a rank, a checkpoint after each; then a resume from the first."""
    args = dict(max_steps=2, per_device_train_batch_size=2, save_strategy="steps", save_steps=1)
    trainer = Trainer(gpt2(), trainer_args(out, **args), train_dataset=sequences())
    metrics = trainer.train().metrics
    with open(f"{out}/checkpoint-1/trainer_state.json") as f:
        saved = json.load(f)["total_flos"]
    logged = trainer.state.log_history[-1]["total_flos"]
    import transformers  # a checkpoint of a Transformers model loads as one (config.json beside the weights)

    loaded = transformers.AutoModelForCausalLM.from_pretrained(f"{out}/checkpoint-2")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), trainer.model.state_dict().values()))
    assert loaded.config.architectures == ["GPT2LMHeadModel"]
    assert os.path.isfile(f"{out}/checkpoint-2/generation_config.json")
    resumed = Trainer(gpt2(), trainer_args(out, **args), train_dataset=sequences()).train(f"{out}/checkpoint-1").metrics
    return metrics["total_flos"], logged, saved, resumed["total_flos"]


def test_total_flos_is_transformers_summed_over_the_ranks(tmp_path):
    import transformers

    hf_args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=2, use_cpu=True,
                                             per_device_train_batch_size=4, report_to="none", disable_tqdm=True,
                                             save_strategy="no")
    theirs = transformers.Trainer(model=gpt2(), args=hf_args, train_dataset=sequences())
    theirs.train()
    total = theirs.state.total_flos
    assert total > 0
    for rank in run_world(flos_world, world_size=2, args=(str(tmp_path / "mine"),)):
        assert rank == (total, total, total / 2, total)


def test_a_model_without_num_parameters_counts_nothing(tmp_path, local_world):
    """As Transformers: 0 operations where the model cannot say (and no all-reduce spent on summing them)."""
    trainer = Trainer(Classifier().double(), trainer_args(tmp_path, max_steps=2, per_device_train_batch_size=4),
                      train_dataset=classification_data(8))
    assert trainer.train().metrics["total_flos"] == 0.0 and not trainer._counts_flos


def test_a_stopped_run_reports_the_flos_its_checkpoint_holds(tmp_path, local_world):
    """SIGTERM or Ctrl-C (asked here as their handler asks) after step 1: the ranks stop after step 2, and what
    train() returns and the stop's checkpoint hold are those 2 steps' operations."""
    from ddpkit.trainer.callbacks import TrainerCallback

    class Interrupt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            trainer._stop.requested = True

    data = sequences()
    trainer = Trainer(gpt2(), trainer_args(tmp_path, max_steps=4, per_device_train_batch_size=4), train_dataset=data,
                      callbacks=[Interrupt()])
    metrics = trainer.train().metrics
    with open(tmp_path / "checkpoint-2" / "trainer_state.json") as f:
        saved = json.load(f)["total_flos"]
    assert metrics["stopped"] == 1.0 and metrics["total_flos"] == saved == 8 * trainer.floating_point_ops(data[0])


def test_save_model_writes_what_from_pretrained_loads(tmp_path, local_world):
    """A Transformers model is saved by its save_pretrained, config.json included, as Transformers' Trainer saves
    it (ddpkit wrote model.safetensors alone, which from_pretrained refused: no config.json); another model as
    model.safetensors. training_args.json either way."""
    import transformers

    model = gpt2()
    Trainer(model, trainer_args(tmp_path / "gpt2")).save_model()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2")
    for (name, mine), (_, loaded) in zip(model.state_dict().items(), back.state_dict().items()):
        assert torch.equal(mine, loaded), name
    assert {"config.json", "training_args.json"} <= set(os.listdir(tmp_path / "gpt2"))
    plain = Classifier()
    Trainer(plain, trainer_args(tmp_path / "plain")).save_model(str(tmp_path / "elsewhere"))
    want = ["model.safetensors", "training_args.bin", "training_args.json"]
    assert sorted(os.listdir(tmp_path / "elsewhere")) == want
    assert all(torch.equal(load_file(tmp_path / "elsewhere" / "model.safetensors")[k], v)
               for k, v in plain.state_dict().items())


def test_a_checkpoint_s_trainer_state_loads_in_transformers(tmp_path, local_world):
    """trainer_state.json holds Transformers' fields alone, with Transformers' meanings (train_batch_size: the batch
    per device): load_from_json raised TypeError on ddpkit's own (loss_since_last_log, plan_arguments, ...), which
    are in ddpkit_state.json beside it."""
    import transformers

    args = trainer_args(tmp_path, max_steps=4, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                        save_strategy="steps", save_steps=2)
    trainer = Trainer(Classifier().double(), args, train_dataset=classification_data(16))
    trainer.train()
    for step in (2, 4):
        loaded = transformers.TrainerState.load_from_json(str(tmp_path / f"checkpoint-{step}" / "trainer_state.json"))
        assert (loaded.global_step, loaded.max_steps, loaded.train_batch_size) == (step, 4, 2)
        assert loaded.log_history == trainer.state.log_history[:step]  # a log a step, the final one after the save
        assert [entry["step"] for entry in loaded.log_history] == list(range(1, step + 1))
        with open(tmp_path / f"checkpoint-{step}" / "ddpkit_state.json") as f:
            ours = json.load(f)
        assert (ours["train_batch_size"], ours["world_size"], ours["train_loss_steps"]) == (2 * 2, 1, step)
    final = transformers.TrainerState.load_from_json(str(tmp_path / "trainer_state.json"))  # the run's, at its end
    assert (final.global_step, final.train_batch_size, final.log_history) == (4, 2, trainer.state.log_history)


def test_a_tokenizer_as_processing_class_pads_and_is_saved_as_transformers_does(tmp_path, local_world):
    """processing_class (a tokenizer): without a data_collator the batches are padded by it (Transformers'
    DataCollatorWithPadding), it goes into every checkpoint (checked by the marker like every file) and into
    save_model's folder, AutoTokenizer loads it from both, and the callbacks get it."""
    import tokenizers
    import transformers

    from ddpkit.checkpoint.files import load_checkpoint
    from ddpkit.trainer.callbacks import TrainerCallback

    words = ["[PAD]", "[UNK]", *"abcdefgh"]
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]")
    config = transformers.GPT2Config(vocab_size=len(words), n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                     num_labels=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2ForSequenceClassification(config)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": tokenizer(" ".join(words[2 + j] for j in torch.randint(0, 8, (n,), generator=g)))
             ["input_ids"], "label": n % 2} for n in torch.randint(2, 9, (12,), generator=g).tolist()]
    seen = []

    class Sees(TrainerCallback):
        def on_train_begin(self, args, state, control, processing_class=None, **kwargs):
            seen.append(processing_class)

    args = trainer_args(tmp_path, max_steps=2, per_device_train_batch_size=4, save_strategy="steps", save_steps=2)
    trainer = Trainer(model, args, train_dataset=data, processing_class=tokenizer, callbacks=[Sees()])
    assert isinstance(trainer.data_collator, transformers.DataCollatorWithPadding) and seen == []
    trainer.train()
    assert seen == [tokenizer]
    # 2 steps of 4 padded samples (a BatchEncoding each, which counted as 1 sample before): 8 of the 12.
    assert abs(trainer.state.epoch - 8 / 12) < 1e-9
    load_checkpoint(str(tmp_path / "checkpoint-2"))  # every file as its marker says, the tokenizer's included
    trainer.save_model(str(tmp_path / "final"))
    for folder in (tmp_path / "checkpoint-2", tmp_path / "final"):
        assert "tokenizer.json" in os.listdir(folder)
        back = transformers.AutoTokenizer.from_pretrained(folder)
        assert back("a b h")["input_ids"] == tokenizer("a b h")["input_ids"] == [2, 3, 9]


def test_compute_loss_func_and_preprocess_logits_for_metrics_as_transformers(tmp_path, local_world):
    """compute_loss_func(outputs, labels, num_items_in_batch): the model gets no labels, the function a sum over
    the global item count, so training equals the model's own mean loss (accumulation included); and
    compute_metrics gets preprocess_logits_for_metrics(logits, labels) of every batch: tensors, a tuple of them too."""
    import torch.nn.functional as F

    seen = {"labels": [], "counts": []}

    def summed_over_count(outputs, labels, num_items_in_batch=None):
        assert outputs["loss"] is None  # the model was called without its labels
        seen["labels"].append(labels is not None)
        seen["counts"].append(float(num_items_in_batch))
        return F.cross_entropy(outputs["logits"], labels, reduction="sum") / num_items_in_batch

    def accuracy(prediction):
        return {"accuracy": float((prediction.predictions == prediction.label_ids).mean())}

    trained = []
    for kwargs in ({}, {"compute_loss_func": summed_over_count}):
        torch.manual_seed(0)
        args = trainer_args(tmp_path / str(len(trained)), max_steps=3, per_device_train_batch_size=3,
                            gradient_accumulation_steps=2)
        trainer = Trainer(Classifier().double(), args, train_dataset=classification_data(18), **kwargs,
                          compute_metrics=accuracy, preprocess_logits_for_metrics=lambda logits, _: logits.argmax(-1))
        trainer.train()
        trained.append(trainer.model.state_dict())
    assert seen["labels"] and all(seen["labels"]) and set(seen["counts"][:6]) == {6.0}  # 2 batches of 3 a step
    for name, value in trained[0].items():
        torch.testing.assert_close(trained[1][name], value, rtol=1e-12, atol=1e-12)
    metrics = trainer.evaluate(classification_data(10, seed=1))
    with torch.no_grad():
        logits = trainer.model.eval()(torch.stack([s["x"] for s in classification_data(10, seed=1)]))["logits"]
    labels = torch.stack([s["labels"] for s in classification_data(10, seed=1)])
    assert metrics["eval_accuracy"] == float((logits.argmax(-1) == labels).double().mean())
    trainer.preprocess_logits_for_metrics = lambda logits, labels: (logits.argmax(-1), labels)  # gathered as a tuple
    trainer.compute_metrics = lambda p: {"accuracy": float((p.predictions[0] == p.label_ids).mean()),
                                         "same": bool((p.predictions[1] == p.label_ids).all())}
    again = trainer.evaluate(classification_data(10, seed=1))
    assert again["eval_accuracy"] == metrics["eval_accuracy"] and again["eval_same"] is True
    trainer.preprocess_logits_for_metrics = lambda logits, labels: {"logits": logits}
    with pytest.raises(TypeError, match="preprocess_logits_for_metrics returned dict"):
        trainer.evaluate(classification_data(10, seed=1))


def test_optimizer_cls_and_kwargs_makes_the_trainers_optimizer(tmp_path, local_world):
    trainer = Trainer(Classifier().double(), trainer_args(tmp_path, max_steps=1), train_dataset=classification_data(8),
                      optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.3, "momentum": 0.5}))
    trainer.train()
    assert type(trainer.optimizer) is torch.optim.SGD
    assert [(g["lr"], g["momentum"], g["weight_decay"]) for g in trainer.optimizer.param_groups] == \
        [(0.3, 0.5, 0.0), (0.3, 0.5, 0.0)]  # the constant schedule of trainer_args; no decay on biases


def test_a_processor_that_writes_ddpkits_names_or_folders_loses_no_checkpoint(tmp_path, local_world):
    """processing_class saves first: a file name it shares with the checkpoint (config.json) ends as ddpkit's, and
    every file it adds is in the marker, in a subfolder too (a tokenizer with several chat templates writes
    additional_chat_templates/, which failed every save), so a changed byte there is found at load."""
    from ddpkit.checkpoint.files import load_checkpoint
    from ddpkit.errors import CheckpointError

    class Processor:
        def save_pretrained(self, path):
            os.makedirs(os.path.join(path, "templates"), exist_ok=True)
            for name in ("config.json", "processor_extra.json", os.path.join("templates", "tool_use.jinja")):
                with open(os.path.join(path, name), "w") as f:
                    f.write('{"mine": true}')

    args = trainer_args(tmp_path, max_steps=1, save_strategy="steps", save_steps=1)
    Trainer(gpt2(), args, train_dataset=sequences(4), processing_class=Processor()).train()
    folder = tmp_path / "checkpoint-1"
    load_checkpoint(str(folder))  # every file as its marker says
    with open(folder / "config.json") as f:
        assert json.load(f)["model_type"] == "gpt2"
    with open(folder / "checkpoint_complete.json") as f:
        assert {"processor_extra.json", "templates/tool_use.jinja"} <= set(json.load(f)["crc32"])
    (folder / "templates" / "tool_use.jinja").write_text('{"mine": fals}')
    with pytest.raises(CheckpointError, match="templates/tool_use.jinja"):
        load_checkpoint(str(folder))
    Trainer(gpt2(), args, train_dataset=sequences(4), processing_class=Processor()).save_model(str(tmp_path / "final"))
    with open(tmp_path / "final" / "config.json") as f:  # the model's, which from_pretrained needs
        assert json.load(f)["model_type"] == "gpt2"


def rank_0_saves_world(world, out):
    """save_model under `if trainer.is_world_process_zero()`, as Transformers' scripts call it: rank 0 writes and
    waits for no other rank, which evaluates meanwhile; rank 0's failure raises on rank 0 alone (its exit takes
    the job down). It was a collective: rank 0 met rank 1's evaluation, a deadlock."""
    class Broken:
        def save_pretrained(self, path):
            raise OSError("disk full")

    trainer = Trainer(Classifier().double(), trainer_args(out, ddp_timeout=60), train_dataset=classification_data(8),
                      eval_dataset=classification_data(4, seed=1))
    if trainer.is_world_process_zero():
        trainer.save_model(f"{out}/alone")
    loss = trainer.evaluate()["eval_loss"]
    trainer.saves.processor, told = Broken(), None
    try:
        trainer.save_model(f"{out}/broken")
    except OSError as exc:
        told = str(exc)
    return loss, told, trainer.evaluate()["eval_loss"]


def test_save_model_is_rank_0_alone_as_in_transformers(tmp_path):
    zero, one = run_world(rank_0_saves_world, 2, args=(str(tmp_path),), deadline_s=90)
    assert zero == (one[0], "disk full", one[0]) and one == (zero[0], None, zero[0])
    assert os.path.isfile(tmp_path / "alone" / "model.safetensors")


def tokens_world(world, out, how, lengths):
    """One epoch of `lengths` token sequences, 2 a batch per rank, padded with an attention mask."""
    def collate(samples):
        longest = max(len(s["input_ids"]) for s in samples)
        ids, mask = torch.zeros(len(samples), longest, dtype=torch.long), torch.zeros(len(samples), longest)
        for row, s in enumerate(samples):
            ids[row, :len(s["input_ids"])], mask[row, :len(s["input_ids"])] = s["input_ids"], 1
        return {"input_ids": ids, "attention_mask": mask.long(), "labels": ids.masked_fill(mask == 0, -100)}

    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, 50, (n,), generator=g)} for n in lengths]
    args = trainer_args(out, max_steps=len(lengths) // (2 * world.world_size), per_device_train_batch_size=2,
                        include_num_input_tokens_seen=how)
    trainer = Trainer(gpt2(), args, train_dataset=data, data_collator=collate)
    trainer.train()
    return trainer.state.num_input_tokens_seen, [e.get("num_input_tokens_seen") for e in trainer.state.log_history]


def test_input_tokens_are_counted_over_every_rank_as_transformers_counts_them(tmp_path):
    """include_num_input_tokens_seen: every rank's batches, summed in the step's own all-reduce; non_padding
    counts the attention mask, all the main input's elements (padding included); logged at each step."""
    lengths = [3, 9, 2, 12, 5, 7, 4, 10]
    for seen, logged in run_world(tokens_world, 2, args=(str(tmp_path / "np"), "non_padding", lengths)):
        assert seen == sum(lengths) and len(logged) == 3 and logged[1:] == [seen, seen], (seen, logged)
        assert 0 < logged[0] < seen  # after the first of the 2 steps (then train()'s summary)
    for seen, logged in run_world(tokens_world, 2, args=(str(tmp_path / "all"), True, [6] * 8)):
        assert (seen, logged) == (6 * 8, [24, 48, 48])
    (off,) = run_world(tokens_world, 1, args=(str(tmp_path / "no"), "no", [6] * 8))
    assert off == (0, [None] * len(off[1]))


def test_label_smoothing_leaves_multi_label_and_labels_it_does_not_smooth_alone(tmp_path, local_world):
    """As Transformers: no smoothing (a warning) for a multi-label classifier, whose float labels name no class
    (the gather failed on them); and a batch whose labels are under another name (label_names) keeps its model's
    own loss and tuple: predict failed, the loss put before the logits twice."""
    import transformers

    config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=16, num_labels=3, problem_type="multi_label_classification")
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    g = torch.Generator().manual_seed(5)
    data = [{"input_ids": torch.randint(1, 40, (6,), generator=g), "labels": torch.rand(3, generator=g).round()}
            for _ in range(8)]
    with pytest.warns(UserWarning, match="ignored for a multi-label"):
        trainer = Trainer(model, trainer_args(tmp_path / "ml", max_steps=2, label_smoothing_factor=0.1),
                          train_dataset=data)
    assert trainer.label_smoothing == 0.0
    trainer.train()

    class Targets(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 3)

        def forward(self, x, target=None):
            logits = self.linear(x)
            return (logits,) if target is None else (torch.nn.functional.cross_entropy(logits, target), logits)

    samples = [{"x": torch.randn(4, generator=g), "target": torch.tensor(i % 3)} for i in range(6)]
    found = []
    for smoothing in (0.0, 0.1):
        torch.manual_seed(0)
        args = trainer_args(tmp_path / str(smoothing), label_names=["target"], label_smoothing_factor=smoothing,
                            per_device_eval_batch_size=3)
        found.append(Trainer(Targets(), args, train_dataset=samples).predict(samples))
    assert found[1].predictions.shape == (6, 3)
    np.testing.assert_array_equal(found[1].predictions, found[0].predictions)
    assert found[1].metrics["test_loss"] == found[0].metrics["test_loss"]


def test_the_trainer_takes_transformers_arguments_in_transformers_order(tmp_path, local_world):
    """Trainer(model, args, data_collator, train_dataset, ...) as Transformers' Trainer: ddpkit's took train_dataset
    third, so a script's positional collator became the data. A dataset there is refused, naming the keywords."""
    import inspect

    import transformers

    ours, theirs = (list(inspect.signature(t.__init__).parameters) for t in (Trainer, transformers.Trainer))
    assert ours == theirs
    collate = lambda samples: {"x": torch.stack([s["x"] for s in samples])}  # noqa: E731 - a positional collator
    assert Trainer(Classifier(), trainer_args(tmp_path / "order"), collate).data_collator is collate
    with pytest.raises(TypeError, match="pass the datasets by name"):
        Trainer(Classifier(), trainer_args(tmp_path / "data"), classification_data(8))


def test_model_init_makes_the_model_after_the_seed_as_transformers_train_does(tmp_path, local_world):
    """Transformers' train() seeds, then calls model_init (with the trial None where it takes an argument): the same
    weights here. Its errors too: a model beside it (ValueError), optimizers beside it, neither, or a model_init of
    two arguments (RuntimeError)."""
    import transformers

    data = classification_data(8)
    hf_args = transformers.TrainingArguments(str(tmp_path / "hf"), seed=7, learning_rate=0.0, max_steps=1,
                                             use_cpu=True, report_to="none", save_strategy="no")
    hf = transformers.Trainer(model_init=lambda: Classifier().double(), args=hf_args, train_dataset=data)
    hf.train()
    torch.manual_seed(0)  # whatever came before: model_init runs after the args' seed
    mine = Trainer(args=trainer_args(tmp_path / "mine"), train_dataset=data,
                   model_init=lambda trial: Classifier().double())
    for got, want in zip(mine.model.state_dict().values(), hf.model.state_dict().values()):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=0)
    mine.args.max_steps = 2
    mine.train()
    first = [p.detach().clone() for p in mine.model.parameters()]
    mine.train()  # each train() call trains a fresh model, as Transformers' calls do: the same weights again
    for once, again in zip(first, mine.model.parameters()):
        torch.testing.assert_close(once, again.detach(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="but not both"):
        Trainer(torch.nn.Linear(2, 2), trainer_args(tmp_path / "both"), model_init=lambda: Classifier())
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="incompatible with providing the `optimizers`"):
        Trainer(args=trainer_args(tmp_path / "opt"), model_init=lambda: Classifier(), optimizers=(opt, None))
    with pytest.raises(RuntimeError, match="either a `model` or `model_init`"):
        Trainer(args=trainer_args(tmp_path / "none"))
    with pytest.raises(RuntimeError, match="0 or 1 argument"):
        Trainer(args=trainer_args(tmp_path / "two"), model_init=lambda a, b: Classifier())
