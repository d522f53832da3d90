"""ddpkit.args.transformers_only: Transformers' TrainingArguments fields that ddpkit's have not, taken at Transformers'
default and refused otherwise with what to do instead; its script-only fields taken."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ddpkit.args.parser import ArgumentParser
from ddpkit.args.training_args import TrainingArguments
from ddpkit.args.transformers_only import FOREIGN, NORMALISED, ForeignArgument
from ddpkit.errors import ArgumentError


def test_the_table_names_transformers_fields_that_ddpkit_has_not_with_their_defaults():
    transformers = pytest.importorskip("transformers")
    theirs = {f.name: f for f in dataclasses.fields(transformers.TrainingArguments)}
    ours = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert not FOREIGN.keys() & ours
    for name, (default, _) in FOREIGN.items():
        field = theirs[name]
        assert (field.default_factory() if field.default is dataclasses.MISSING else field.default) == default, name
    assert {"do_train", "do_eval", "do_predict", "run_name", "local_rank"} <= ours  # for the script, as theirs


def test_in_code_a_foreign_field_at_its_default_is_dropped_and_another_value_refused(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), do_train=True, run_name="r", local_rank=0,
                             push_to_hub=False, log_level="passive", average_tokens_across_devices=True)
    assert (args.do_train, args.run_name) == (True, "r") and "log_level" not in dataclasses.asdict(args)
    for kwargs, hint in ((dict(fsdp="full_shard"), "ddp_zero_stage=1 or 2"),
                         (dict(use_liger_kernel=True), "does not implement it"),
                         (dict(average_tokens_across_devices=False), "items of every rank's batches"),
                         (dict(tf32=True), "allow_tf32 yourself")):
        with pytest.raises(ForeignArgument, match=hint) as caught:
            TrainingArguments(output_dir=str(tmp_path), **kwargs)
        # A TypeError, as an unknown keyword is, and ddpkit's ArgumentError naming the field.
        assert isinstance(caught.value, TypeError) and isinstance(caught.value, ArgumentError)
        assert caught.value.field == next(iter(kwargs)) and str(caught.value).startswith(f"{caught.value.field}: ")
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        TrainingArguments(output_dir=str(tmp_path), bogus=1)
    assert dataclasses.replace(args, seed=3).seed == 3


def test_a_script_reads_a_foreign_field_at_transformers_default_and_cannot_set_another(tmp_path):
    """A script reads Transformers' fields off its arguments (run_ner.py read eval_do_concat_batches before
    ddpkit had it): an AttributeError here, once the field was dropped. Every foreign field reads as its default
    (a fresh copy)."""
    args = TrainingArguments(output_dir=str(tmp_path))
    for name, (default, _) in FOREIGN.items():
        assert getattr(args, name) == NORMALISED.get(name, [default])[0], name  # as Transformers' __post_init__
    assert args.eval_use_gather_object is False and args.deepspeed is None and args.log_level == "passive"
    assert args.debug == [] and args.activation_checkpointing is False
    args.debug.append("underflow_overflow")
    assert args.debug == []  # a fresh copy each read
    args.eval_use_gather_object = False  # the default: nothing to refuse, nothing kept
    assert "eval_use_gather_object" not in vars(args)
    with pytest.raises(ForeignArgument, match="eval_use_gather_object=True"):
        args.eval_use_gather_object = True
    assert args.eval_use_gather_object is False
    with pytest.raises(AttributeError, match="no attribute 'bogus'"):
        args.bogus  # noqa: B018 - a name that is no field of either stays an AttributeError

    @dataclasses.dataclass
    class Mine(TrainingArguments):  # a script's own field may take a Transformers-only name: then it is its own
        debug: bool = False
        log_level: str = "info"

    mine = Mine(output_dir=str(tmp_path), debug=True)
    assert (mine.debug, mine.log_level) == (True, "info")
    mine.log_level = "warning"
    assert mine.log_level == "warning" and Mine(output_dir=str(tmp_path)).debug is False


def test_on_the_command_line_and_in_a_dict(tmp_path, capsys):
    parser = ArgumentParser(TrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--do_train", "--do-eval",
                                                  "--local-rank=1", "--run_name", "r"])
    assert (args.do_train, args.do_eval, args.do_predict, args.local_rank, args.run_name) == (True, True, False, 1, "r")
    with pytest.raises(SystemExit) as exited:
        parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--push-to-hub"])
    assert exited.value.code == 2 and "--push_to_hub is a Transformers" in capsys.readouterr().err
    (args,) = parser.parse_dict({"output_dir": str(tmp_path), "push_to_hub": False, "seed": 3})
    assert args.seed == 3
    with pytest.raises(ForeignArgument, match="ddp_zero_stage"):
        parser.parse_dict({"output_dir": str(tmp_path), "deepspeed": "ds.json"})
    with pytest.raises(ArgumentError, match=r"unknown argument\(s\) \['bogus'\]"):
        parser.parse_dict({"output_dir": str(tmp_path), "bogus": 1})


def test_the_trainer_takes_no_args_as_transformers_does_and_refuses_a_transformers_one(tmp_path):
    """None: TrainingArguments() (Transformers' Trainer does the same); a Transformers TrainingArguments, which
    lacks ddpkit's fields: a TypeError saying what to build, before any process group exists."""
    transformers = pytest.importorskip("transformers")
    from ddpkit.args.training_args import trainer_arguments
    from ddpkit.trainer.trainer import Trainer

    assert trainer_arguments(None) == TrainingArguments()
    with pytest.raises(TypeError, match="takes ddpkit.TrainingArguments, not transformers.training_args"):
        Trainer(torch.nn.Linear(2, 1), transformers.TrainingArguments(str(tmp_path), report_to="none"))
    assert not torch.distributed.is_initialized()


def test_a_dict_of_transformers_arguments_and_a_subclass_are_read_as_transformers_would(tmp_path):
    """Transformers' own to_dict() (its normalised defaults: accelerator_config as a dict, hub_token masked, debug
    a list, torch_compile_backend None) loads; a dataclass subclass of TrainingArguments, whose __init__ is its
    own, still drops and refuses Transformers' fields."""
    transformers = pytest.importorskip("transformers")
    theirs = transformers.TrainingArguments(str(tmp_path), report_to="none", learning_rate=3e-4, seed=5)
    (ours,) = ArgumentParser(TrainingArguments).parse_dict(theirs.to_dict())
    assert (ours.learning_rate, ours.seed, ours.torch_compile, ours.torch_compile_backend) == (3e-4, 5, False,
                                                                                               "inductor")

    @dataclasses.dataclass
    class Script(TrainingArguments):
        extra: int = 3

    assert Script(output_dir=str(tmp_path), push_to_hub=False, extra=4).extra == 4
    with pytest.raises(ForeignArgument, match="ddp_zero_stage"):
        Script(output_dir=str(tmp_path), fsdp="full_shard")


def test_the_batch_sizes_a_script_reads_are_transformers_properties(tmp_path):
    """Transformers' run_clm.py computes `training_args.train_batch_size * gradient_accumulation_steps *
    world_size`: a number per process, as there (ddpkit's was a method of the global batch: a TypeError)."""
    import transformers

    kw = dict(output_dir=str(tmp_path), per_device_train_batch_size=6, per_device_eval_batch_size=5,
              gradient_accumulation_steps=2, use_cpu=True)
    ours, theirs = TrainingArguments(**kw), transformers.TrainingArguments(**kw)
    assert (ours.train_batch_size, ours.eval_batch_size) == (theirs.train_batch_size, theirs.eval_batch_size) == (6, 5)
    assert ours.train_batch_size * ours.gradient_accumulation_steps * 2 == ours.global_train_batch_size(2) == 24


def test_the_helpers_a_script_calls_are_transformers(tmp_path):
    import datetime

    import transformers

    kw = dict(output_dir=str(tmp_path), warmup_steps=0.1, ddp_timeout=90, report_to=["tensorboard"], use_cpu=True)
    ours, theirs = TrainingArguments(**kw), transformers.TrainingArguments(**kw)
    assert ours.get_warmup_steps(95) == theirs.get_warmup_steps(95) == 10
    assert ours.ddp_timeout_delta == theirs.ddp_timeout_delta == datetime.timedelta(seconds=90)
    mine, hf = ours.to_sanitized_dict(), theirs.to_sanitized_dict()
    assert all(type(v) in (bool, int, float, str) for v in mine.values())
    for name in ("report_to", "train_batch_size", "eval_batch_size", "learning_rate", "output_dir", "warmup_steps"):
        assert mine[name] == hf[name], name
