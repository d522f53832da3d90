"""What a training script does with the Trainer's results, under Transformers' names, as its example scripts do
after `train()`:

    result = trainer.train()
    trainer.save_model()
    trainer.log_metrics("train", result.metrics)     # printed on rank 0, formatted as Transformers prints them
    trainer.save_metrics("train", result.metrics)    # output_dir/train_results.json and all_results.json
    trainer.save_state()                             # output_dir/trainer_state.json
    trainer.create_model_card(finetuned_from="gpt2") # output_dir/README.md: how it was trained, its results

Rank 0 prints and writes; every file is replaced whole (ddpkit._utils.atomic), never left half-written. Nothing here
is a collective: any rank may call these, and only rank 0 acts.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

from ddpkit._utils.atomic import replacing
from ddpkit.checkpoint.files import write_json


def metrics_format(metrics: dict[str, Any]) -> dict[str, Any]:
    """Metrics as log_metrics prints them, by Transformers' rules: memory in MB, runtimes as h:mm:ss.ff, total_flos
    in GF, other floats to 4 decimals."""
    formatted = dict(metrics)
    for key, value in metrics.items():
        if "_mem_" in key:
            formatted[key] = f"{int(value) >> 20}MB"
        elif "_runtime" in key:
            formatted[key] = _duration(value)
        elif key == "total_flos":
            formatted[key] = f"{int(value) >> 30}GF"
        elif isinstance(value, float):
            formatted[key] = round(value, 4)
    return formatted


def _duration(seconds: float) -> str:
    """0:01:02.34 for 62.3456 s: whole seconds as timedelta prints them, then the hundredths (cut, not rounded)."""
    return f"{datetime.timedelta(seconds=int(seconds))}.{int(abs(seconds - int(seconds)) * 100):02d}"


class ResultsMixin:
    """The Trainer's (it has `args`, `world`, `model`, `optimizer`, `state` and `saves`)."""

    args: Any
    world: Any
    model: Any
    optimizer: Any
    state: Any
    saves: Any

    def is_world_process_zero(self) -> bool:
        """Whether this is rank 0 of the whole job, the one process that writes."""
        return bool(self.world.is_main)

    def is_local_process_zero(self) -> bool:
        """Whether this is the first process of its node."""
        return bool(self.world.is_local_main)

    def metrics_format(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """Transformers': the metrics as log_metrics prints them (runtimes as h:mm:ss.ss, floats rounded)."""
        return metrics_format(metrics)

    def log_metrics(self, split: str, metrics: dict[str, Any]) -> None:
        """Print `metrics` under a "***** <split> metrics *****" header, one aligned line each, on rank 0."""
        if not self.is_world_process_zero() or not metrics:
            return
        formatted = metrics_format(metrics)
        key_width = max(len(str(key)) for key in formatted)
        value_width = max(len(str(value)) for value in formatted.values())
        print(f"***** {split} metrics *****")
        for key in sorted(formatted):
            print(f"  {key: <{key_width}} = {formatted[key]:>{value_width}}")

    def save_metrics(self, split: str, metrics: dict[str, Any], combined: bool = True) -> None:
        """output_dir/<split>_results.json holds `metrics`; with `combined`, all_results.json gains them too (its
        earlier metrics kept, these over them). Rank 0 writes."""
        if not self.is_world_process_zero():
            return
        os.makedirs(self.args.output_dir, exist_ok=True)
        write_json(os.path.join(self.args.output_dir, f"{split}_results.json"), metrics)
        if combined:
            path = os.path.join(self.args.output_dir, "all_results.json")
            every: dict[str, Any] = {}
            if os.path.exists(path):
                with open(path, encoding="utf-8") as f:
                    every = json.load(f)
            write_json(path, {**every, **metrics})

    def save_state(self) -> None:
        """output_dir/trainer_state.json: the progress so far (Transformers' TrainerState fields, which its
        TrainerState.load_from_json reads), as training writes it when it ends. Rank 0 writes."""
        if self.is_world_process_zero():
            os.makedirs(self.args.output_dir, exist_ok=True)
        self.saves.write_final_state(self.state)

    def create_model_card(self, language: str | None = None, license: str | None = None,
                          tags: str | list[str] | None = None, model_name: str | None = None,
                          finetuned_from: str | None = None, tasks: str | list[str] | None = None,
                          dataset_tags: str | list[str] | None = None, dataset: str | list[str] | None = None,
                          dataset_args: str | list[str] | None = None) -> None:
        """output_dir/README.md: a model card (Transformers' arguments in its metadata header, then how the model
        was trained and its last results, from args and state.log_history). Rank 0 writes."""
        if not self.is_world_process_zero():
            return
        name = model_name or os.path.basename(os.path.abspath(self.args.output_dir))
        header = {"library_name": "ddpkit", "base_model": finetuned_from, "language": language, "license": license,
                  "tags": ["ddpkit", *_listed(tags)], "datasets": _listed(dataset_tags) or None,
                  "pipeline_tag": _listed(tasks)[0] if tasks else None}
        os.makedirs(self.args.output_dir, exist_ok=True)
        with replacing(os.path.join(self.args.output_dir, "README.md")) as f:
            f.write(model_card(name, header, self._hyperparameters(), self.state.log_history, finetuned_from,
                               " ".join(_listed(dataset) + [f"({arg})" for arg in _listed(dataset_args)]) or None))

    def _hyperparameters(self) -> dict[str, Any]:
        args, world = self.args, self.world.world_size
        return {"learning_rate": args.learning_rate, "train_batch_size (per process)": args.per_device_train_batch_size,
                "eval_batch_size (per process)": args.per_device_eval_batch_size, "processes": world,
                "gradient_accumulation_steps": args.gradient_accumulation_steps,
                "total_train_batch_size": args.global_train_batch_size(world), "seed": args.seed,
                "optimizer": type(self.optimizer).__name__ if self.optimizer is not None else args.optim,
                "lr_scheduler_type": args.lr_scheduler_type, "training_steps": self.state.global_step,
                "epochs": round(self.state.epoch, 4), "mixed_precision": "bf16" if args.bf16 else
                "fp16" if args.fp16 else "no", "zero_stage": args.ddp_zero_stage}

    def get_num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def get_learning_rates(self) -> list[float]:
        """Each param group's current learning rate."""
        return [group["lr"] for group in self._made_optimizer().param_groups]

    def get_optimizer_group(self, param: Any = None) -> Any:
        """Transformers': the param group that holds `param` (a parameter, or its name in the model), else every
        group's params."""
        groups = self._made_optimizer().param_groups
        if isinstance(param, str):
            param = dict(self.model.named_parameters()).get(param)
        if param is not None:
            for group in groups:
                if any(p is param for p in group["params"]):
                    return group
        return [group["params"] for group in groups]

    def _made_optimizer(self) -> Any:
        if self.optimizer is None:
            raise ValueError("the Trainer has no optimizer yet: train() creates it (or create_optimizer(), or pass "
                             "optimizers=(optimizer, scheduler))")
        return self.optimizer


def model_card(name: str, header: dict[str, Any], hyperparameters: dict[str, Any], log_history: list[dict],
               base: str | None = None, dataset: str | None = None) -> str:
    """A model card's markdown: a metadata header (the entries that are set), how the model was trained, and the
    last training loss and evaluation metrics logged."""
    lines = ["---"] + [f"{key}: {json.dumps(value)}" for key, value in header.items() if value is not None]
    lines += ["---", "", f"# {name}", "", "This model was trained with ddpkit's Trainer"
              + (f", from {base}" if base else "") + (f", on {dataset}" if dataset else "") + ".", "",
              "## Training hyperparameters", ""]
    lines += [f"- {key}: {value}" for key, value in hyperparameters.items()]
    losses = [entry for entry in log_history if "loss" in entry]
    evaluations = [entry for entry in log_history if any(key.startswith("eval_") for key in entry)]
    if losses or evaluations:
        lines += ["", "## Results", "", "| logged at step | what | value |", "|---|---|---|"]
        if losses:
            lines.append(f"| {losses[-1]['step']} | training loss | {losses[-1]['loss']:.4f} |")
        for key, value in (evaluations[-1].items() if evaluations else ()):
            if key.startswith("eval_") and isinstance(value, (int, float)):
                lines.append(f"| {evaluations[-1]['step']} | {key} | {value:.4g} |")
    return "\n".join(lines) + "\n"


def _listed(value: str | list[str] | None) -> list[str]:
    return [] if value is None else [value] if isinstance(value, str) else list(value)


__all__ = ["ResultsMixin", "metrics_format", "model_card"]
