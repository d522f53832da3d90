"""Callbacks: code of the user's that the Trainer runs at the moments of a run, with the Transformers names.

    class StopAtLoss(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and logs.get("loss", 1.0) < 0.1:
                control.should_training_stop = True

    trainer = Trainer(model, args, train_dataset=data, callbacks=[StopAtLoss()])

Each event gets (args, state, control, **kwargs): the TrainingArguments, the TrainerState, the TrainerControl, and
model, optimizer, lr_scheduler, train_dataloader, eval_dataloader, plus `logs` (on_log) or `metrics`
(on_evaluate). A callback that returns a TrainerControl replaces the control. Transformers' own callbacks
(`transformers.EarlyStoppingCallback`, ...) work as they are: only the method names matter.

Callbacks run on every rank, but what they ask of the Trainer (stop, save, evaluate, log, end the epoch) is
what rank 0's callbacks asked: the Trainer takes the control's flags from rank 0 (`Agreement`) before it acts on
them, so a callback that decides from rank-local numbers cannot make the ranks part and hang. A flag set inside
a step (on_substep_end, on_pre_optimizer_step, on_optimizer_step) is acted on when the step ends: every rank runs
the whole agreed window of micro-batches, so that their all-reduces match.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from ddpkit.distributed.comm import Comm, flags_of_main, max_over_ranks

_POSITIONAL = {"on_evaluate": "metrics", "on_predict": "metrics", "on_log": "logs"}
_CLEARED = {"on_train_begin": ("should_training_stop",), "on_epoch_begin": ("should_epoch_stop",),
            "on_step_begin": ("should_log", "should_evaluate", "should_save"), "on_evaluate": ("should_evaluate",),
            "on_save": ("should_save",), "on_log": ("should_log",)}
EVENTS = ("on_init_end", "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_step_begin",
          "on_substep_end", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end", "on_evaluate",
          "on_prediction_step", "on_predict", "on_log", "on_save")


@dataclasses.dataclass
class TrainerControl:
    """The switches callbacks set. should_training_stop stays set; should_epoch_stop is cleared when an epoch
    begins; should_save, should_evaluate and should_log when a step begins."""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False

    @property
    def should_stop(self) -> bool:
        """Another name of should_training_stop."""
        return self.should_training_stop

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self.should_training_stop = bool(value)

    def state(self) -> dict[str, Any]:
        """Transformers' ExportableState: the switches as they stand, under "args"."""
        return {"args": {f.name: bool(getattr(self, f.name)) for f in dataclasses.fields(self)}, "attributes": {}}

    def _new_training(self) -> None:
        self.should_training_stop = False

    def _new_epoch(self) -> None:
        self.should_epoch_stop = False

    def _new_step(self) -> None:
        self.should_save = self.should_evaluate = self.should_log = False

    def flags(self) -> list[bool]:
        return [bool(getattr(self, f.name)) for f in dataclasses.fields(self)]

    def set_flags(self, flags: list[bool]) -> None:
        for field, value in zip(dataclasses.fields(self), flags):
            setattr(self, field.name, bool(value))


class TrainerCallback:
    """Override the events you need; each may change `control` in place or return a TrainerControl."""

    def on_init_end(self, args, state, control, **kwargs): pass
    def on_train_begin(self, args, state, control, **kwargs): pass
    def on_train_end(self, args, state, control, **kwargs): pass
    def on_epoch_begin(self, args, state, control, **kwargs): pass
    def on_epoch_end(self, args, state, control, **kwargs): pass
    def on_step_begin(self, args, state, control, **kwargs): pass
    def on_substep_end(self, args, state, control, **kwargs): pass  # each micro-batch of a step but the last
    def on_pre_optimizer_step(self, args, state, control, **kwargs): pass  # gradients averaged and clipped
    def on_optimizer_step(self, args, state, control, **kwargs): pass  # before the schedule and zero_grad
    def on_step_end(self, args, state, control, **kwargs): pass
    def on_evaluate(self, args, state, control, metrics=None, **kwargs): pass
    def on_prediction_step(self, args, state, control, **kwargs): pass  # each evaluation or prediction batch
    def on_predict(self, args, state, control, metrics=None, **kwargs): pass  # Trainer.predict's metrics
    def on_log(self, args, state, control, logs=None, **kwargs): pass
    def on_save(self, args, state, control, **kwargs): pass


def _restore(callback: Any, saved: dict[str, Any]) -> None:
    args = saved.get("args") or {}
    if args:
        try:
            type(callback).__init__(callback, **args)
        except TypeError as error:
            raise TypeError(f"restore_callback_states_from_checkpoint: {type(callback).__name__} cannot be built "
                            f"again from the arguments its checkpoint saved ({sorted(args)}): {error}. Its state() "
                            "must save its __init__'s arguments, or set restore_callback_states_from_checkpoint "
                            "to False") from error
    for key, value in saved.get("attributes", {}).items():
        setattr(callback, key, value)


class CallbackHandler:
    """The Trainer's callbacks, in order, and the objects every event hands them."""

    def __init__(self, callbacks: list[Any] | None = None):
        self.callbacks: list[Any] = []
        for callback in callbacks or ():
            self.add_callback(callback)
        self.objects: dict[str, Any] = {}  # model, optimizer, ...: kept current by the Trainer

    def add_callback(self, callback: Any) -> None:
        """An instance, or a class to instantiate without arguments."""
        instance = callback() if isinstance(callback, type) else callback
        if not any(callable(getattr(instance, event, None)) for event in EVENTS):
            raise TypeError(f"{type(instance).__name__} is not a callback: it defines none of the events "
                            f"{', '.join(EVENTS)}; subclass ddpkit.TrainerCallback (or transformers'")
        self.callbacks.append(instance)

    def pop_callback(self, callback: Any) -> Any:
        """Remove `callback` (an instance, or the first instance of a class) and return it; None if absent."""
        for i, present in enumerate(self.callbacks):
            if present is callback or (isinstance(callback, type) and isinstance(present, callback)):
                return self.callbacks.pop(i)
        return None

    def remove_callback(self, callback: Any) -> None:
        self.pop_callback(callback)

    def export_states(self, control: TrainerControl | None = None) -> dict[str, Any]:
        """What the callbacks with a `state()` (Transformers' ExportableState) export, by class name: a list when
        several share a class; and the control's, as Transformers saves it (written, not restored: every train()
        call starts with its switches off). Saved in trainer_state.json's stateful_callbacks."""
        states: dict[str, list[Any]] = {}
        for callback in [*self.callbacks, *([] if control is None else [control])]:
            if callable(getattr(callback, "state", None)):
                states.setdefault(type(callback).__name__, []).append(callback.state())
        return {name: found[0] if len(found) == 1 else found for name, found in states.items()}

    def restore_states(self, saved: dict[str, Any]) -> None:
        """Each stateful callback as the checkpoint saved it, as Transformers restores it: built again from its
        saved `args` (in place: the object the script holds, in its place in the list), then its `attributes`
        set; callbacks of classes the checkpoint does not name keep their state."""
        seen: dict[str, int] = {}
        for callback in self.callbacks:
            name = type(callback).__name__
            if not callable(getattr(callback, "state", None)) or name not in saved:
                continue
            states = saved[name] if isinstance(saved[name], list) else [saved[name]]
            index = seen[name] = seen.get(name, -1) + 1
            if index < len(states):
                _restore(callback, states[index])

    def __getattr__(self, name: str) -> Any:
        """Transformers' handler methods, which a Trainer subclass calls itself (its question-answering trainer:
        `self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)`):
        on_<event>(args, state, control, ...) clears the flags Transformers' clears there (on_evaluate's
        should_evaluate, ...), calls every callback's and returns the control."""
        if name in EVENTS:
            return functools.partial(self._event, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _event(self, event: str, args: Any, state: Any, control: TrainerControl, *given: Any,
               **kwargs: Any) -> TrainerControl:
        for flag in _CLEARED.get(event, ()):  # as Transformers' handler clears them before the callbacks
            setattr(control, flag, False)
        if given:  # Transformers' positional extras: on_evaluate's and on_predict's metrics, on_log's logs
            if event not in _POSITIONAL or len(given) > 1:
                takes = ", ".join(["args", "state", "control", *([_POSITIONAL[event]] if event in _POSITIONAL else [])])
                raise TypeError(f"{event} takes ({takes}) and keyword arguments, got {len(given)} more positional")
            kwargs[_POSITIONAL[event]] = given[0]
        return self.call(event, args, state, control, **kwargs)

    def call_event(self, event: str, args: Any, state: Any, control: TrainerControl, **kwargs: Any) -> TrainerControl:
        """Transformers' name for `call`: every callback's `event`, the control returned."""
        return self.call(event, args, state, control, **kwargs)

    def call(self, event: str, args: Any, state: Any, control: TrainerControl, **kwargs: Any) -> TrainerControl:
        for callback in self.callbacks:
            method = getattr(callback, event, None)
            if method is None:
                continue
            result = method(args, state, control, **self.objects, **kwargs)
            if result is not None:  # a callback may return the control it changed (or another one)
                control = result
        return control


class Agreement:
    """Rank 0's control flags on every rank: one broadcast at each point the Trainer acts on them. Whether any
    rank has callbacks is agreed once per run (`start`): without callbacks the flags never change, so a run
    without them pays for no broadcast per step."""

    def __init__(self, comm: Comm, device: Any):
        self.comm = comm
        self.device = device
        self.needed = False

    def start(self, handler: CallbackHandler) -> None:
        self.needed = max_over_ranks(self.comm, float(bool(handler.callbacks)), "callbacks present", self.device) > 0

    def settle(self, control: TrainerControl, moment: str) -> TrainerControl:
        if self.needed:
            control.set_flags(flags_of_main(self.comm, control.flags(), f"callback control at {moment}",
                                            self.device))
        return control


__all__ = ["Agreement", "CallbackHandler", "EVENTS", "TrainerCallback", "TrainerControl"]
