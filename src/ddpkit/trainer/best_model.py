"""The best checkpoint of a run (`load_best_model_at_end`, `metric_for_best_model`, `greater_is_better`).

    best = BestModel.for_args(args)        # None when no metric ranks the checkpoints
    best.note_evaluation(state, metrics)    # after each scheduled evaluation: best_metric, best_global_step
    best.note_save(state, folder, step)     # before writing checkpoint-<step>: best_model_checkpoint
    best.protected(state)                   # what rotation must keep
    best.load_at_end(state, load)           # the best weights back into the model when training ends

The state's fields are Transformers' (best_metric, best_global_step, best_model_checkpoint in
trainer_state.json), so a resumed run goes on ranking against the best of the run it resumes. A checkpoint is
ranked by the evaluation made at the step it was saved at (the arguments' validation makes every save follow an
evaluation); a save without one (a stop, the final save) leaves the best where it was.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any


class BestModel:
    def __init__(self, metric: str, greater_is_better: bool, load_at_end: bool):
        self.key = metric if metric.startswith("eval_") else f"eval_{metric}"
        self.greater_is_better = greater_is_better
        self.load_at_end_asked = load_at_end

    @classmethod
    def for_args(cls, args: Any) -> BestModel | None:
        if args.metric_for_best_model is None:
            return None
        return cls(args.metric_for_best_model, bool(args.greater_is_better), args.load_best_model_at_end)

    def value_of(self, metrics: dict[str, float]) -> float:
        if self.key not in metrics:
            found = ", ".join(sorted(k for k in metrics if k.startswith("eval_"))) or "none"
            raise KeyError(f"metric_for_best_model: the evaluation gave no {self.key!r} (it gave {found}); set "
                           "metric_for_best_model to one of those, or return it from compute_metrics")
        return float(metrics[self.key])

    def is_better(self, value: float, best: float | None) -> bool:
        if math.isnan(value):
            return False  # NaN ranks below everything, as an exploded run should
        if best is None or math.isnan(best):
            return True
        return value > best if self.greater_is_better else value < best

    def note_evaluation(self, state: Any, metrics: dict[str, float]) -> bool:
        """Record the evaluation of state.global_step; whether it is the best so far."""
        value = self.value_of(metrics)
        if not self.is_better(value, state.best_metric):
            return False
        state.best_metric, state.best_global_step = value, state.global_step
        return True

    def note_save(self, state: Any, folder: str, step: int) -> None:
        if state.best_global_step == step:
            state.best_model_checkpoint = folder

    @staticmethod
    def protected(state: Any) -> tuple[str, ...]:
        return (state.best_model_checkpoint,) if state.best_model_checkpoint else ()

    def load_at_end(self, state: Any, load: Callable[[str], None]) -> str | None:
        """Load the best checkpoint's weights (load_best_model_at_end); the folder loaded, or None."""
        path = state.best_model_checkpoint
        if not self.load_at_end_asked or not path:
            return None
        if not os.path.isdir(path):
            raise FileNotFoundError(f"load_best_model_at_end: the best checkpoint {path} is gone (deleted by "
                                    "hand?); its weights cannot be loaded")
        load(path)
        return path


__all__ = ["BestModel"]
