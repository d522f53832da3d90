"""TrainingArguments: Transformers names and defaults, command-line parsing, and every validation error."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpkit.args.parser import ArgumentParser, parse_args
from ddpkit.args.training_args import TrainingArguments
from ddpkit.errors import ArgumentError

# Transformers' documented defaults for the fields we mirror.
TRANSFORMERS_DEFAULTS = dict(
    per_device_train_batch_size=8, per_device_eval_batch_size=8, gradient_accumulation_steps=1, learning_rate=5e-5,
    weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, num_train_epochs=3.0,
    max_steps=-1, lr_scheduler_type="linear", warmup_steps=0, warmup_ratio=0.0, logging_steps=500,
    eval_strategy="no", save_strategy="steps", save_steps=500, save_total_limit=None, seed=42, data_seed=None,
    dataloader_num_workers=0, dataloader_drop_last=False, bf16=False, gradient_checkpointing=False,
    resume_from_checkpoint=None, ddp_backend=None, ddp_timeout=1800, ddp_find_unused_parameters=None,
    ddp_bucket_cap_mb=None, ddp_broadcast_buffers=None,
)


def test_defaults_are_transformers_defaults():
    args = TrainingArguments()
    for name, value in TRANSFORMERS_DEFAULTS.items():
        assert getattr(args, name) == value, name
    assert args.eval_steps == args.logging_steps  # Transformers: eval_steps defaults to logging_steps
    assert args.find_unused_parameters is True and args.broadcast_buffers is True
    assert args.reporters == []


def test_every_field_has_a_help_line_shown_by_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for field in dataclasses.fields(TrainingArguments):
        help_ = field.metadata["help"]
        assert help_ and "\n" not in help_, field.name
        assert f"--{field.name}" in text, field.name
        assert " ".join(help_.split()) in text, field.name


def test_command_line_like_transformers():
    args = parse_args(["--learning_rate", "3e-4", "--bf16", "--num_train_epochs", "2.5", "--max-steps", "7",
                       "--ddp_find_unused_parameters", "false", "--report_to", "tensorboard", "--logging_steps=10",
                       "--save_total_limit", "2", "--ddp_timeout", "60", "--dataloader_drop_last", "true",
                       "--lr_scheduler_type", "cosine", "--eval_strategy", "epoch", "--output_dir", "run"])
    assert args.learning_rate == 3e-4 and isinstance(args.learning_rate, float)
    assert args.bf16 is True and args.dataloader_drop_last is True
    assert args.num_train_epochs == 2.5 and args.max_steps == 7 and isinstance(args.max_steps, int)
    assert args.ddp_find_unused_parameters is False and args.find_unused_parameters is False
    assert args.report_to == ["tensorboard"] and args.reporters == ["tensorboard"]
    assert args.logging_steps == 10 and args.eval_steps == 10
    assert args.save_total_limit == 2 and args.ddp_timeout == 60.0
    assert (args.lr_scheduler_type, args.eval_strategy, args.output_dir) == ("cosine", "epoch", "run")
    assert parse_args(["--bf16", "false"]).bf16 is False
    assert parse_args(["--report_to", "all"]).reporters == ["tensorboard"]


def test_resume_true_means_newest(tmp_path):
    assert parse_args(["--resume_from_checkpoint", "true"]).resume_from_checkpoint is True
    assert parse_args(["--resume_from_checkpoint", str(tmp_path)]).resume_from_checkpoint == str(tmp_path)


def test_fractional_intervals_and_derived_values():
    args = TrainingArguments(logging_steps=0.1, save_steps=0.25, warmup_ratio=0.1, per_device_train_batch_size=4,
                             gradient_accumulation_steps=3)
    assert args.interval("logging_steps", 95) == 10 and args.interval("save_steps", 95) == 24
    assert args.interval("eval_steps", 95) == 10
    assert args.warmup_steps_for(95) == 10
    assert TrainingArguments(warmup_steps=3, warmup_ratio=0.5).warmup_steps_for(95) == 3
    # Transformers 5: a warmup_steps below 1 is a ratio of the total steps (ddpkit refused it as not whole).
    assert TrainingArguments(warmup_steps=0.1, warmup_ratio=0.5).warmup_steps_for(95) == 10
    assert parse_args(["--warmup_steps", "0.25"]).warmup_steps_for(10) == 3
    assert args.global_train_batch_size(world_size=2) == 24
    assert TrainingArguments(load_best_model_at_end=True, eval_strategy="steps", eval_steps=0.2,
                             save_steps=0.6).save_steps == 0.6  # 3 x 0.2, compared in millionths
    whole = TrainingArguments(save_steps=4.0).save_steps
    assert whole == 4 and isinstance(whole, int)


def test_gradient_checkpointing_flips_ddp_defaults():
    args = TrainingArguments(gradient_checkpointing=True)
    assert args.find_unused_parameters is False and args.broadcast_buffers is False
    TrainingArguments(gradient_checkpointing=True, ddp_find_unused_parameters=False, ddp_broadcast_buffers=False)


INVALID = [
    ("per_device_train_batch_size", dict(per_device_train_batch_size=0)),
    ("per_device_eval_batch_size", dict(per_device_eval_batch_size=-1)),
    ("gradient_accumulation_steps", dict(gradient_accumulation_steps=0)),
    ("learning_rate", dict(learning_rate=-1.0)),
    ("learning_rate", dict(learning_rate=float("inf"))),
    ("weight_decay", dict(weight_decay=-0.1)),
    ("adam_beta1", dict(adam_beta1=1.0)),
    ("adam_beta2", dict(adam_beta2=-0.5)),
    ("adam_epsilon", dict(adam_epsilon=-1e-8)),
    ("max_grad_norm", dict(max_grad_norm=-1.0)),
    ("max_steps", dict(max_steps=0)),
    ("num_train_epochs", dict(num_train_epochs=0)),
    ("lr_scheduler_type", dict(lr_scheduler_type="warmup_stable_decay")),
    ("warmup_steps", dict(warmup_steps=-1)),
    ("warmup_steps", dict(warmup_steps=2.5)),
    ("warmup_ratio", dict(warmup_ratio=1.5)),
    ("logging_steps", dict(logging_steps=0)),
    ("eval_strategy", dict(eval_strategy="sometimes")),
    ("eval_steps", dict(eval_steps=-2)),
    ("save_strategy", dict(save_strategy="best")),
    ("save_steps", dict(save_steps=0)),
    ("save_total_limit", dict(save_total_limit=0)),
    ("load_best_model_at_end", dict(load_best_model_at_end=True)),  # eval_strategy "no": nothing ranks them
    ("load_best_model_at_end", dict(load_best_model_at_end=True, eval_strategy="steps", save_strategy="epoch")),
    ("load_best_model_at_end", dict(load_best_model_at_end=True, eval_strategy="steps", eval_steps=3,
                                    save_steps=4)),
    # Fractions of the total (Transformers' rule): the best checkpoint was rotated away unevaluated.
    ("load_best_model_at_end", dict(load_best_model_at_end=True, eval_strategy="steps", eval_steps=0.3,
                                    save_steps=0.5)),
    ("load_best_model_at_end", dict(load_best_model_at_end=True, eval_strategy="steps", eval_steps=0.2,
                                    save_steps=10)),
    ("eval_steps", dict(eval_steps=2.5)),  # it was cut to 2
    ("logging_steps", dict(logging_steps=1.5)),
    ("seed", dict(seed=-1)),
    ("data_seed", dict(data_seed=2**32)),
    ("dataloader_num_workers", dict(dataloader_num_workers=-1)),
    ("output_dir", dict(output_dir="")),
    ("report_to", dict(report_to="wandb")),
    ("report_to", dict(report_to=["none", "tensorboard"])),
    ("resume_from_checkpoint", dict(resume_from_checkpoint="/no/such/checkpoint-7")),
    ("ddp_backend", dict(ddp_backend="carrier-pigeon")),
    ("ddp_timeout", dict(ddp_timeout=0)),
    ("label_smoothing_factor", dict(label_smoothing_factor=-0.1)),
    ("include_num_input_tokens_seen", dict(include_num_input_tokens_seen="some")),
    ("label_smoothing_factor", dict(label_smoothing_factor=1.0)),
    ("ddp_bucket_cap_mb", dict(ddp_bucket_cap_mb=0)),
    ("ddp_find_unused_parameters", dict(gradient_checkpointing=True, ddp_find_unused_parameters=True)),
    ("ddp_broadcast_buffers", dict(gradient_checkpointing=True, ddp_broadcast_buffers=True)),
]
if not torch.cuda.is_available():
    INVALID.append(("ddp_backend", dict(ddp_backend="nccl")))


@pytest.mark.parametrize("field,kwargs", INVALID, ids=[f"{f}-{i}" for i, (f, _) in enumerate(INVALID)])
def test_every_validation_error_names_its_field(field, kwargs):
    with pytest.raises(ArgumentError) as err:
        TrainingArguments(**kwargs)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}:")


@pytest.mark.skipif(torch.cuda.is_available(), reason="nccl is usable on this machine")
def test_nccl_without_cuda_fails_on_the_command_line_before_any_process_group(capsys):
    import torch.distributed as dist

    with pytest.raises(SystemExit) as exit_:
        parse_args(["--ddp_backend", "nccl"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--ddp_backend" in err and "CUDA" in err
    assert not dist.is_initialized()


@pytest.mark.parametrize("argv,needle", [
    (["--learning_rate", "fast"], "learning_rate"),
    (["--max_steps", "2.5"], "max_steps"),
    (["--bf16", "maybe"], "bf16"),
    (["--lr_scheduler_type", "warmup_stable_decay"], "lr_scheduler_type"),
    (["--gradient_checkpointing", "--ddp_find_unused_parameters", "true"], "ddp_find_unused_parameters"),
    (["--no_such_flag", "1"], "no_such_flag"),
])
def test_command_line_errors_exit_naming_the_field(argv, needle, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2
    assert needle in capsys.readouterr().err


def test_script_dataclasses_share_the_parser():
    @dataclasses.dataclass
    class ScriptArguments:
        hidden: int = dataclasses.field(default=64, metadata={"help": "Hidden width."})
        tie: bool = dataclasses.field(default=True, metadata={"help": "Tie embeddings."})

    parser = ArgumentParser((ScriptArguments, TrainingArguments))
    script, args = parser.parse_args_into_dataclasses(["--hidden", "32", "--no_tie", "--seed", "3"])
    assert (script.hidden, script.tie, args.seed) == (32, False, 3)
    script, args, extra = parser.parse_args_into_dataclasses(["--bogus", "x"], allow_extra=True)
    assert extra == ["--bogus", "x"]
    (args,) = ArgumentParser().parse_dict({"learning_rate": 1e-3})
    assert args.learning_rate == 1e-3
    with pytest.raises(ArgumentError, match="lerning_rate"):
        ArgumentParser().parse_dict({"lerning_rate": 1e-3})


def test_to_json_round_trip():
    import json

    args = TrainingArguments(learning_rate=1e-3, report_to=["tensorboard"])
    assert TrainingArguments(**json.loads(args.to_json_string())) == args


@settings(max_examples=60, deadline=None)
@given(lr=st.floats(0, 10, allow_nan=False), bs=st.integers(1, 4096), accum=st.integers(1, 64),
       steps=st.one_of(st.just(-1), st.integers(1, 10**6)), ratio=st.floats(0, 1), seed=st.integers(0, 2**32 - 1),
       clip=st.floats(0, 100))
def test_valid_values_survive_the_command_line(lr, bs, accum, steps, ratio, seed, clip):
    argv = ["--learning_rate", repr(lr), "--per_device_train_batch_size", str(bs), "--gradient_accumulation_steps",
            str(accum), "--max_steps", str(steps), "--warmup_ratio", repr(ratio), "--seed", str(seed),
            "--max_grad_norm", repr(clip)]
    args = parse_args(argv)
    assert args == TrainingArguments(learning_rate=lr, per_device_train_batch_size=bs,
                                     gradient_accumulation_steps=accum, max_steps=steps, warmup_ratio=ratio,
                                     seed=seed, max_grad_norm=clip)
    assert args.global_train_batch_size(world_size=2) == 2 * bs * accum


def test_a_command_line_error_is_one_line_printed_by_rank_zero_only(capsys, monkeypatch, tmp_path):
    for rank, printed in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        with pytest.raises(SystemExit) as exit_:
            parse_args(["--max_steps", "0"])
        assert exit_.value.code == 2  # every rank fails alike
        err = capsys.readouterr().err
        if printed:
            assert "max_steps" in err and "usage:" not in err and len(err.strip().splitlines()) == 2, err
        else:
            assert err == ""
    # Under a launcher every rank records it: the rank that exits first is the root cause, with the message
    # (rank 0 alone recording it lost the message whenever another rank exited first and rank 0 was stopped).
    monkeypatch.setenv("RANK", "1")
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    with pytest.raises(SystemExit):
        parse_args(["--max_steps", "0"])
    assert capsys.readouterr().err == ""
    assert "max_steps: must be > 0" in error_file.read_text()


def test_under_the_launcher_a_bad_flag_is_reported_once(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from helpers.world import clean_env

    script = Path(__file__).parent.parent.parent / "examples" / "train_digits.py"
    env = clean_env()
    done = subprocess.run([sys.executable, "-m", "ddpkit", "launch", "--nproc-per-node", "2", str(script),
                           "--output_dir", str(tmp_path), "--max_steps", "0"], env=env, capture_output=True,
                          text=True, timeout=120)
    said = done.stdout + done.stderr
    assert done.returncode != 0
    assert said.count("max_steps: must be > 0") == 1, said
    assert "usage:" not in said, said


# -- fp16, torch_compile, optim (issue 12) --------------------------------------------------------------------------

FLAG_ERRORS = [
    ("fp16", dict(fp16=True, bf16=True), "bf16"),
    ("optim", dict(optim="lion"), "adamw_torch, adamw_torch_fused, sgd, adafactor"),
    ("optim", dict(optim="adafactor", ddp_zero_stage=2), "ddp_zero_stage 0 or 1"),
    ("optim_args", dict(optim="sgd", optim_args="momentum"), "k1=v1,k2=v2"),
    ("optim_args", dict(optim="sgd", optim_args="betas=0.9"), "momentum, dampening, nesterov"),
    ("optim_args", dict(optim="adamw_torch", optim_args="momentum=0.9"), "its keys: none"),
    ("optim_args", dict(optim="sgd", optim_args="momentum=fast"), "must be a number"),
    ("optim_args", dict(optim="sgd", optim_args="nesterov=maybe"), "true or false"),
    ("optim_args", dict(optim="sgd", optim_args="nesterov=true"), "momentum > 0"),
    ("optim_args", dict(optim="sgd", optim_args="momentum=-1"), ">= 0"),
    ("optim_args", dict(optim="adafactor", optim_args="d=0.5"), "d >= 1"),
    ("torch_compile_backend", dict(torch_compile=True, torch_compile_backend="nope"), "inductor"),
    ("torch_compile_backend", dict(torch_compile_backend="nope"), "inductor"),  # naming one turns compile on
    ("torch_compile_mode", dict(torch_compile_mode="fast"), "max-autotune"),
    ("torch_compile_mode", dict(torch_compile_backend="aot_eager", torch_compile_mode="max-autotune"), "inductor"),
]
if not torch.cuda.is_available():
    FLAG_ERRORS.append(("fp16", dict(fp16=True), "on a CPU use bf16"))


@pytest.mark.parametrize("field,kwargs,hint", FLAG_ERRORS, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(FLAG_ERRORS)])
def test_the_transformers_flags_fail_naming_the_field_and_the_fix(field, kwargs, hint):
    with pytest.raises(ArgumentError) as err:
        TrainingArguments(**kwargs)
    assert err.value.field == field and str(err.value).startswith(f"{field}:")
    assert hint in str(err.value)


def test_the_transformers_flags_parse_with_their_defaults():
    args = TrainingArguments()
    assert (args.fp16, args.optim, args.optim_args) == (False, "adamw_torch", None)
    assert (args.torch_compile, args.torch_compile_backend, args.torch_compile_mode) == (False, "inductor", None)
    args = parse_args(["--optim", "sgd", "--optim_args", "momentum=0.9, nesterov=true", "--torch_compile",
                       "--torch_compile_backend", "aot_eager"])
    assert (args.optim, args.optim_args, args.torch_compile, args.torch_compile_backend) == (
        "sgd", "momentum=0.9, nesterov=true", True, "aot_eager")
    from ddpkit.args.validation import parse_optim_args

    assert parse_optim_args(args.optim_args, "sgd") == {"momentum": 0.9, "nesterov": True}
    assert parse_optim_args("beta2_decay=-0.5,d=2", "adafactor") == {"beta2_decay": -0.5, "d": 2.0}
    # As Transformers: naming a mode (or a backend other than the default) turns compilation on.
    assert parse_args(["--torch_compile_mode", "max-autotune"]).torch_compile is True
    assert TrainingArguments(torch_compile_backend="eager").torch_compile is True
    assert TrainingArguments(optim="adafactor", ddp_zero_stage=1).optim == "adafactor"


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 is valid on this machine")
def test_fp16_on_a_cpu_fails_on_the_command_line_suggesting_bf16(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--fp16"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--fp16" in err and "CUDA" in err and "bf16" in err


def test_the_transformers_fields_users_set_take_its_defaults_and_are_checked(tmp_path):
    """logging_strategy, logging_first_step, lr_scheduler_kwargs, use_cpu, label_names, eval_on_start,
    save_only_model and remove_unused_columns: Transformers' defaults, JSON from the command line, bad values named."""
    import transformers

    ours, theirs = TrainingArguments(output_dir=str(tmp_path)), transformers.TrainingArguments(str(tmp_path))
    for name in ("logging_strategy", "logging_first_step", "lr_scheduler_kwargs", "use_cpu", "label_names",
                 "eval_on_start", "save_only_model", "remove_unused_columns"):
        assert getattr(ours, name) == getattr(theirs, name) or (name, getattr(theirs, name)) == (
            "logging_strategy", transformers.IntervalStrategy.STEPS), name
    (parsed,) = ArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--lr_scheduler_type", "polynomial", "--lr_scheduler_kwargs",
         '{"lr_end": 1e-6, "power": 2}', "--logging_strategy", "epoch", "--label_names", "labels", "extra",
         "--no_remove_unused_columns", "--save_only_model", "--eval_on_start", "--logging_first_step"])
    assert parsed.lr_scheduler_kwargs == {"lr_end": 1e-6, "power": 2} and parsed.label_names == ["labels", "extra"]
    assert (parsed.logging_strategy, parsed.remove_unused_columns, parsed.save_only_model) == ("epoch", False, True)
    assert parsed.eval_on_start and parsed.logging_first_step
    for bad, message in ((dict(logging_strategy="sometimes"), "logging_strategy: must be one of"),
                         (dict(lr_scheduler_kwargs="{nope"), "lr_scheduler_kwargs: must be a JSON object"),
                         (dict(lr_scheduler_kwargs={"power": 2}), "linear takes none; unknown: \\['power'\\]"),
                         (dict(lr_scheduler_type="polynomial", lr_scheduler_kwargs={"lr_end": 1.0}),
                          "lr_end \\(1.0\\) must be below learning_rate"),
                         (dict(lr_scheduler_type="inverse_sqrt", lr_scheduler_kwargs={"timescale": 0}),
                          "timescale must be >= 1"),
                         (dict(label_names=[3]), "label_names: must be a list")):
        with pytest.raises(ArgumentError, match=message):
            TrainingArguments(output_dir=str(tmp_path), **bad)


def test_include_num_input_tokens_seen_reads_as_transformers_writes_it(tmp_path):
    """A bool or a word, in code and on the command line (the flag alone is True, which is "all")."""
    out = ["--output_dir", str(tmp_path)]
    for argv, want in (([], "no"), (["--include_num_input_tokens_seen"], "all"),
                       (["--include-num-input-tokens-seen", "false"], "no"),
                       (["--include_num_input_tokens_seen=non_padding"], "non_padding")):
        assert parse_args(out + argv).include_num_input_tokens_seen == want, argv
    args = TrainingArguments(output_dir=str(tmp_path), include_num_input_tokens_seen=True)
    assert args.include_num_input_tokens_seen == "all"
    with pytest.raises(ArgumentError, match="include_num_input_tokens_seen"):
        TrainingArguments(output_dir=str(tmp_path), include_num_input_tokens_seen=2)


def test_a_list_of_bools_in_a_script_dataclass_still_takes_several_values():
    import dataclasses as dc

    @dc.dataclass
    class Script:
        flags: list[bool] = dc.field(default_factory=list)
        mode: str | bool = "no"

    parsed, extra = ArgumentParser(Script).parse_known_args(["--flags", "true", "false", "--mode"])
    assert len(parsed.flags) == 2 and extra == []
    (script,) = ArgumentParser(Script).parse_args_into_dataclasses(["--mode"])
    assert script.mode is True  # str | bool: the flag alone
