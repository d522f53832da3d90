"""Training arguments: the Transformers names, defaults and meanings.

    args = TrainingArguments(output_dir="out", learning_rate=3e-4)           # in code
    args, = ArgumentParser(TrainingArguments).parse_args_into_dataclasses()  # from the command line: parser.py

Each field's help lives in its metadata and becomes its ``--help`` line (args_cli), so the two cannot drift.
Invalid values and contradictory combinations raise `ArgumentError` naming the field as soon as the dataclass is
built, which is before any process group exists. Transformers' fields that ddpkit has not are refused with what to
do instead (args_foreign); the process facts a script reads off them (device, should_log) are args_process's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any

from ddpkit.args.process import ProcessMixin
from ddpkit.args.transformers_only import ForeignDefaults, ForeignDropping
from ddpkit.args.validation import DDP_BACKENDS, REPORTERS, SAVE_STRATEGIES, SCHEDULERS, STRATEGIES, validate
from ddpkit.errors import ArgumentError


def _field(default: Any, help: str, **metadata: Any) -> Any:
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata={"help": help, **metadata})
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


@dataclasses.dataclass
class TrainingArguments(ProcessMixin, ForeignDefaults, metaclass=ForeignDropping):
    """Hyper-parameters of one run. Sizes are per process ("per device") unless the help says global."""

    output_dir: str = _field("trainer_output", "Where checkpoints, logs, metrics and the loss curve are written.")
    per_device_train_batch_size: int = _field(8, "Training batch size per process (per data-parallel rank).")
    per_device_eval_batch_size: int = _field(8, "Evaluation batch size per process.")
    include_for_metrics: list[str] = _field([], "What compute_metrics also gets: inputs (each sample's main model "
                                                "input), loss (each sample's batch loss).")
    prediction_loss_only: bool = _field(False, "evaluate and predict compute the loss only: no predictions (None "
                                               "from predict), no compute_metrics.")
    batch_eval_metrics: bool = _field(False, "Call compute_metrics(prediction, compute_result) at every evaluation "
                                             "step, over that step's batches (compute_result True at the last, where "
                                             "it returns the metrics), instead of keeping every prediction.")
    eval_do_concat_batches: bool = _field(True, "The predictions (and labels, inputs, losses) compute_metrics and "
                                                "predict give: one array (True), or a list of one array per step "
                                                "(False), a step being one batch of every rank.")
    eval_accumulation_steps: int | None = _field(None, "Taken for Transformers' scripts: ddpkit moves each batch's "
                                                       "predictions off the device at once, as 1 does there.")
    gradient_accumulation_steps: int = _field(1, "Micro-batches accumulated per optimizer step.")
    learning_rate: float = _field(5e-5, "Peak learning rate of the optimizer (optim).")
    weight_decay: float = _field(0.0, "Weight decay (decoupled for AdamW and Adafactor, L2 for sgd); not applied to "
                                                 "biases and norm weights.")
    adam_beta1: float = _field(0.9, "AdamW beta1.")
    adam_beta2: float = _field(0.999, "AdamW beta2.")
    adam_epsilon: float = _field(1e-8, "AdamW epsilon.")
    max_grad_norm: float = _field(1.0, "Clip the global gradient norm to this value; 0 disables clipping.")
    num_train_epochs: float = _field(3.0, "Epochs to train (a fraction stops part-way through the last one).")
    max_steps: int = _field(-1, "Optimizer steps to train; > 0 overrides num_train_epochs, -1 uses epochs.")
    lr_scheduler_type: str = _field("linear", "Learning-rate schedule after warmup.", choices=SCHEDULERS)
    warmup_steps: float = _field(0, "Linear warmup steps from 0 to learning_rate (a float < 1: a fraction of the "
                                    "total steps, as in Transformers 5); overrides warmup_ratio.")
    warmup_ratio: float = _field(0.0, "Linear warmup as a fraction of the total optimizer steps.")
    lr_scheduler_kwargs: dict | str | None = _field(None, "Extra arguments of the schedule, a dict (JSON on the "
                                                        "command line): polynomial takes lr_end (1e-7) and power "
                                                        "(1.0), inverse_sqrt timescale (default: the warmup steps, "
                                                        "or 10000), cosine and cosine_with_restarts num_cycles.")
    logging_strategy: str = _field("steps", "When to log the training loss: no, steps (every logging_steps) or "
                                            "epoch (at each epoch's end).", choices=STRATEGIES)
    logging_steps: float = _field(500, "Log every N optimizer steps (a float < 1: a fraction of the total).")
    logging_nan_inf_filter: bool = _field(True, "A step whose loss is nan or inf is logged, and counted in train_loss, "
                                                "as the sum since the last log over 1 + its steps (Transformers' "
                                                "stand-in); eval_loss leaves such batches out.")
    logging_first_step: bool = _field(False, "Also log the loss of the first optimizer step.")
    eval_strategy: str = _field("no", "When to evaluate: no, steps (every eval_steps) or epoch.", choices=STRATEGIES)
    eval_steps: float | None = _field(None, "Evaluate every N optimizer steps; defaults to logging_steps.")
    eval_delay: float = _field(0, "No scheduled evaluation before this many steps (eval_strategy steps) or epochs "
                                  "(epoch) have passed.")
    save_strategy: str = _field("steps", "When to checkpoint: no, steps (every save_steps), epoch, or best (after "
                                         "an evaluation that beats the best metric_for_best_model so far).",
                                choices=SAVE_STRATEGIES)
    save_steps: float = _field(500, "Checkpoint every N optimizer steps (a float < 1: a fraction of the total).")
    save_total_limit: int | None = _field(None, "Keep at most this many checkpoints, deleting the oldest.")
    load_best_model_at_end: bool = _field(False, "Keep the checkpoint with the best metric_for_best_model (never "
                                                 "rotated away) and load its weights when training ends; needs "
                                                 "eval_strategy = save_strategy (or save_strategy best) and "
                                                 "saves on evaluated steps.")
    metric_for_best_model: str | None = _field(None, "The evaluation metric that ranks checkpoints (eval_ may be "
                                                     "left out); default: loss when load_best_model_at_end.")
    greater_is_better: bool | None = _field(None, "Whether a larger metric_for_best_model is better; default: "
                                                  "False when the metric ends in 'loss', True otherwise.")
    eval_on_start: bool = _field(False, "Evaluate once before the first step (a sanity check of the evaluation).")
    save_only_model: bool = _field(False, "Checkpoints hold the model weights and the run's progress only: no "
                                          "optimizer, schedule or gradient scaler. Smaller, but a run cannot "
                                          "resume from them (ddpkit refuses to; a restart under --max-restarts "
                                          "fails so too). The checkpoint of a SIGTERM or Ctrl-C stop is whole.")
    remove_unused_columns: bool = _field(True, "Drop the keys of mapping samples that model.forward does not "
                                               "take (but label, label_ids and label_names) before collating.")
    label_names: list[str] | None = _field(None, "Batch keys that hold labels, kept by remove_unused_columns "
                                                 "whatever model.forward takes (ddpkit reads the labels of the "
                                                 "loss's items and of label_ids from 'labels').")
    use_cpu: bool = _field(False, "Train on the CPU (gloo) even where an accelerator is visible.")
    seed: int = _field(42, "Random seed set on every process at the start (model init, dropout).")
    data_seed: int | None = _field(None, "Seed of the data shuffling; defaults to seed.")
    full_determinism: bool = _field(False, "Seed, and run deterministic kernels only (torch."
                                           "use_deterministic_algorithms, cuDNN deterministic, cuBLAS's workspace): "
                                           "slower, bitwise repeatable.")
    dataloader_num_workers: int = _field(0, "Worker processes per data loader (0: load in the main process).")
    dataloader_drop_last: bool = _field(False, "Drop each process's last incomplete training batch.")
    train_sampling_strategy: str = _field("random", "The training order: random (shuffled anew each epoch, from "
                                                    "data_seed), sequential (the dataset's order) or group_by_length "
                                                    "(shuffled, then samples of similar length batched together: "
                                                    "less padding).")
    length_column_name: str = _field("length", "group_by_length: the dataset column of precomputed sample lengths; "
                                               "without one each sample's first model input is measured.")
    dataloader_pin_memory: bool = _field(True, "Pin the batches' memory for a faster copy to the GPU (on GPUs only).")
    dataloader_persistent_workers: bool = _field(False, "Keep a loader's workers between its passes (needs "
                                                        "dataloader_num_workers > 0).")
    dataloader_prefetch_factor: int | None = _field(None, "Batches each worker loads ahead (needs "
                                                          "dataloader_num_workers > 0; torch's default 2).")
    dataloader_multiprocessing_context: str | None = _field(None, "How loader workers start: fork, spawn or "
                                                                  "forkserver (needs dataloader_num_workers > 0; "
                                                                  "torch's default when unset).")
    bf16: bool = _field(False, "Run forward passes under bfloat16 autocast (CPU and recent GPUs).")
    # Transformers' fp16, torch_compile and optim flags (ddpkit.trainer.precision, ddpkit.trainer.parallelize, ddpkit.trainer.optimizers):
    fp16: bool = _field(False, "float16 autocast with a gradient scaler (torch.amp.GradScaler): the loss is scaled, "
                               "gradients unscaled before clipping, a step with inf/nan gradients skipped (with its "
                               "schedule step) on every rank alike; CUDA only (on a CPU use bf16).")
    torch_compile: bool = _field(False, "torch.compile the training model: the DDP wrapper is compiled (Dynamo "
                                        "splits the graph at its buckets, so the all-reduces overlap the compiled "
                                        "backward); evaluation and saving use the plain module.")
    torch_compile_backend: str | None = _field("inductor", "torch.compile backend (torch._dynamo.list_backends()); "
                                                           "a backend other than inductor turns torch_compile on.")
    torch_compile_mode: str | None = _field(None, "torch.compile mode of inductor, one of "
                                                  "torch._inductor.list_mode_options(); setting it turns "
                                                  "torch_compile on.")
    optim: str = _field("adamw_torch", "Optimizer: adamw_torch (torch.optim.AdamW), adamw_torch_fused (its fused "
                                       "kernel; CPU and GPU), sgd (torch.optim.SGD), adafactor "
                                       "(torch.optim.Adafactor: learning_rate caps its relative step; not "
                                       "Transformers' own Adafactor, whose steps differ).")
    optim_args: str | None = _field(None, "Optimizer arguments as 'k1=v1,k2=v2': sgd takes momentum, dampening, "
                                          "nesterov; adafactor takes beta2_decay, d.")
    include_num_input_tokens_seen: str | bool = _field("no", "Count the input tokens trained on, over every rank, "
                                                            "into num_input_tokens_seen (state and logs): all, "
                                                            "non_padding (the attention mask's) or no.")
    neftune_noise_alpha: float | None = _field(None, "NEFTune: while training, uniform noise of alpha / sqrt(length "
                                                     "x width) on the input embeddings (get_input_embeddings()).")
    label_smoothing_factor: float = _field(0.0, "Label smoothing: the loss mixes (1 - x) of the labels' and x of "
                                                "a uniform target's cross-entropy over the vocabulary or classes.")
    gradient_checkpointing: bool = _field(False, "Recompute activations in backward to save memory "
                                                 "(calls model.gradient_checkpointing_enable()).")
    gradient_checkpointing_kwargs: dict | str | None = _field(None, "Its keyword arguments, a dict (JSON on the "
                                                                    "command line): '{\"use_reentrant\": false}'.")
    restore_callback_states_from_checkpoint: bool = _field(False, "On resume, give the callbacks that export "
                                                                  "a state (state()) what they saved.")
    resume_from_checkpoint: str | None = _field(None, "Checkpoint folder to resume from; 'true': the newest in "
                                                      "output_dir.")
    report_to: list[str] = _field(["none"], "Integrations to log to: tensorboard, all or none.")  # noqa: RUF009
    disable_tqdm: bool | None = _field(None, "Hide the progress bar (shown on rank 0 by default).")
    ddp_backend: str | None = _field(None, "Collective backend (nccl, gloo, ...); default: picked from the device.",
                                     choices=DDP_BACKENDS)
    ddp_timeout: float = _field(1800, "Seconds any collective may wait before it raises (on CPU too).")
    ddp_find_unused_parameters: bool | None = _field(None, "DDP find_unused_parameters; default: False with "
                                                           "gradient checkpointing, True otherwise.")
    ddp_bucket_cap_mb: int | None = _field(None, "DDP gradient bucket size in MiB; default: DDP's own (25).")
    ddp_static_graph: bool | None = _field(None, "DDP static_graph, as torch's; ddpkit's DDP handles unused parameters "
                                                 "and reentrant checkpointing on any graph either way.")
    torch_empty_cache_steps: int | None = _field(None, "Empty the accelerator's memory cache every N optimizer steps "
                                                       "(lower peak memory, slower steps).")
    ddp_broadcast_buffers: bool | None = _field(None, "DDP broadcast_buffers; default: False with gradient "
                                                      "checkpointing, True otherwise.")
    # ddpkit's own, not in Transformers:
    ddp_stall_seconds: float | None = _field(None, "Seconds a collective may wait before ddpkit explains which "
                                                   "ranks are missing and where (again at each doubling); 0: off; "
                                                   "default: ddp_timeout/5, at most 60.")
    ddp_replica_check_steps: int = _field(500, "Every this many optimizer steps, check that every replica is "
                                               "bitwise identical to rank 0's; 0: never.")
    ddp_zero_stage: int = _field(0, "ZeRO sharding across the data-parallel ranks: 0 = plain DDP (every rank "
                                    "holds all optimizer state and gradients); 1 = optimizer state sharded "
                                    "(ddpkit.ZeroRedundancyOptimizer); 2 = gradients sharded too "
                                    "(DistributedDataParallel(zero_stage=2)).", choices=(0, 1, 2))
    ddp_timeline_steps: str | None = _field(None, "Record optimizer steps A:B (both included, e.g. 3:8) of every "
                                                  "rank into output_dir/timeline.json, a Chrome trace; print a "
                                                  "summary.")
    # Transformers' fields for the training script itself, which its Trainer does not read either:
    do_train: bool = _field(False, "For your script: whether to train (the Trainer does not read it).")
    do_eval: bool = _field(False, "For your script: whether to evaluate (the Trainer does not read it).")
    do_predict: bool = _field(False, "For your script: whether to predict (the Trainer does not read it).")
    run_name: str | None = _field(None, "A name for the run, for your script (ddpkit's tensorboard logs do not "
                                        "use it, nor do Transformers').")
    local_rank: int = _field(-1, "What the deprecated torch.distributed.launch passes (--local-rank); ddpkit "
                                 "reads LOCAL_RANK from the environment, which every launcher sets.")

    def __post_init__(self) -> None:
        if isinstance(self.report_to, str):
            self.report_to = [self.report_to]
        if self.report_to is None:
            self.report_to = ["none"]
        if isinstance(self.resume_from_checkpoint, str) and self.resume_from_checkpoint.lower() in ("true", "latest"):
            self.resume_from_checkpoint = True  # type: ignore[assignment]  # the newest in output_dir
        for name in ("lr_scheduler_kwargs", "gradient_checkpointing_kwargs"):  # from the command line: JSON, as there
            if isinstance(getattr(self, name), str):
                setattr(self, name, _json_dict(name, getattr(self, name)))
        for name in ("label_names", "include_for_metrics"):  # one name, as a list of one
            if isinstance(getattr(self, name), str):
                setattr(self, name, [getattr(self, name)])
        if self.eval_steps is None:
            self.eval_steps = self.logging_steps
        if self.load_best_model_at_end and self.metric_for_best_model is None:
            self.metric_for_best_model = "loss"
        if self.greater_is_better is None and self.metric_for_best_model is not None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")
        tokens = self.include_num_input_tokens_seen  # Transformers': True (--include_num_input_tokens_seen) is "all"
        if isinstance(tokens, bool) or str(tokens).lower() in ("yes", "true", "t", "y", "1", "false", "f", "n", "0"):
            self.include_num_input_tokens_seen = "all" if string_to_bool(tokens) else "no"
        if self.torch_compile_backend is None:  # Transformers' default, which means inductor's
            self.torch_compile_backend = "inductor"
        if self.torch_compile_mode is not None or self.torch_compile_backend != "inductor":
            self.torch_compile = True  # Transformers: naming a mode or a backend asks for compilation
        if self.warmup_steps >= 1 and float(self.warmup_steps).is_integer():
            self.warmup_steps = int(self.warmup_steps)  # below 1 a fraction; validate() names 2.5
        for name in ("logging_steps", "eval_steps", "save_steps"):
            value = getattr(self, name)
            if 1 <= value < math.inf and float(value).is_integer():  # validate() names 2.5 and a non-finite one
                setattr(self, name, int(value))
        validate(self)

    # -- derived values -----------------------------------------------------------------------------------------
    @property
    def train_batch_size(self) -> int:
        """Transformers': the samples one process trains on per forward (per_device_train_batch_size; one device a
        process). Scripts multiply it by gradient_accumulation_steps and world_size."""
        return self.per_device_train_batch_size

    @property
    def eval_batch_size(self) -> int:
        """Transformers': the samples one process evaluates per forward (per_device_eval_batch_size)."""
        return self.per_device_eval_batch_size

    def global_train_batch_size(self, world_size: int = 1) -> int:
        """Global samples per optimizer step: per-device batch x processes x accumulation."""
        return self.per_device_train_batch_size * world_size * self.gradient_accumulation_steps

    def warmup_steps_for(self, total_steps: int) -> int:
        """warmup_steps (below 1: that fraction of total_steps, rounded up, as Transformers 5), else warmup_ratio's."""
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        return math.ceil((self.warmup_steps or self.warmup_ratio) * total_steps)

    def get_warmup_steps(self, num_training_steps: int) -> int:
        """Transformers' name for warmup_steps_for."""
        return self.warmup_steps_for(num_training_steps)

    def interval(self, name: str, total_steps: int) -> int:
        """logging_steps, eval_steps or save_steps in optimizer steps (a fraction < 1 is of total_steps)."""
        value = getattr(self, name)
        return max(1, math.ceil(value * total_steps)) if value < 1 else int(value)

    @property
    def find_unused_parameters(self) -> bool:
        if self.ddp_find_unused_parameters is not None:
            return self.ddp_find_unused_parameters
        return not self.gradient_checkpointing

    @property
    def broadcast_buffers(self) -> bool:
        if self.ddp_broadcast_buffers is not None:
            return self.ddp_broadcast_buffers
        return not self.gradient_checkpointing

    @property
    def reporters(self) -> list[str]:
        """The integrations to use: report_to with "all" expanded and "none" removed."""
        if "all" in self.report_to:
            return list(REPORTERS)
        return [r for r in self.report_to if r != "none"]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def to_sanitized_dict(self) -> dict[str, Any]:
        """Transformers': to_dict with the batch sizes, every value that is no bool, int, float or str as its
        str (what a tracker's hyperparameter table takes)."""
        found = {**self.to_dict(), "train_batch_size": self.train_batch_size, "eval_batch_size": self.eval_batch_size}
        return {k: v if type(v) in (bool, int, float, str) else str(v) for k, v in found.items()}


def trainer_arguments(args: Any) -> TrainingArguments:
    """The Trainer's args: these as given, TrainingArguments() for None (as Transformers' Trainer), else a TypeError
    that says how to build them (a Transformers TrainingArguments lacks ddpkit's fields)."""
    if args is None or isinstance(args, TrainingArguments):
        return TrainingArguments() if args is None else args
    raise TypeError(f"ddpkit.Trainer takes ddpkit.TrainingArguments, not {type(args).__module__}."
                    f"{type(args).__qualname__}: build ddpkit.TrainingArguments with the same Transformers names "
                    "(ddpkit.TrainingArguments(output_dir=..., learning_rate=...)); its --help lists them")


def _json_dict(name: str, text: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise ArgumentError(name, f"must be a JSON object such as '{{\"key\": 2.0}}' ({exc.msg}; got "
                                  f"{text!r})") from None
    if not isinstance(value, dict):
        raise ArgumentError(name, f"must be a JSON object (a dict), got {text!r}")
    return value


# -- command line ---------------------------------------------------------------------------------------------

def string_to_bool(value: str | bool) -> bool:
    if isinstance(value, bool):
        return value
    if value.lower() in ("yes", "true", "t", "y", "1"):
        return True
    if value.lower() in ("no", "false", "f", "n", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {value!r}")


__all__ = ["TrainingArguments", "string_to_bool", "trainer_arguments", "validate"]
