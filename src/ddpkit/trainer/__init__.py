"""The Trainer, with the Transformers Trainer's surface, and everything only it uses: the loop (`loop`), the step
plan (`schedule`), the micro-batches of a step (`step_batches`) and the optimizer step (`optimizer_step`),
choosing DDP or ZeRO (`parallelize`, `sharding`), precision, optimizers, loss, data loaders, evaluation
(`evaluate`, `eval_gather`, `batch_metrics`), callbacks, the best model, checkpoints of a run (`checkpoints`),
its state and its reports.

May import: every package but ddpkit.bench and ddpkit.cli. The Trainer calls no collective directly: Comm does.
"""

from ddpkit.trainer.callbacks import TrainerCallback, TrainerControl
from ddpkit.trainer.trainer import (EvalLoopOutput, EvalPrediction, PredictionOutput, Trainer, TrainerState, TrainOutput,
                                    get_scheduler, set_seed)

__all__ = ["EvalLoopOutput", "EvalPrediction", "PredictionOutput", "Trainer", "TrainerCallback", "TrainerControl",
           "TrainerState", "TrainOutput", "get_scheduler", "set_seed"]
