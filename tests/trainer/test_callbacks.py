"""Callbacks: the events in their order on every rank, the control flags taken from rank 0 (so a rank-local
decision can never part the ranks), a callback present on one rank only, and Transformers' own callbacks."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ddpkit.engine.params_in_flight import InFlight
from ddpkit.trainer.callbacks import CallbackHandler, TrainerCallback, TrainerControl
from ddpkit.trainer.trainer import Trainer
from helpers.models import Classifier, classification_data, params_of, trainer_args
from helpers.world import run_world

# -- the pieces ----------------------------------------------------------------------------------------------------

def test_control_flags_round_trip_and_should_stop_names_should_training_stop():
    control = TrainerControl()
    control.should_stop = True
    assert control.should_training_stop and control.flags() == [True, False, False, False, False]
    other = TrainerControl()
    other.set_flags([False, True, True, False, True])
    assert (other.should_epoch_stop, other.should_save, other.should_evaluate, other.should_log) == (
        True, True, False, True) and not other.should_stop


def test_handler_instantiates_classes_honours_returned_controls_and_refuses_non_callbacks():
    class Replace(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            return TrainerControl(should_save=True)

    class SeesTheReplacement(TrainerCallback):
        seen = None

        def on_step_end(self, args, state, control, **kwargs):
            SeesTheReplacement.seen = (control.should_save, sorted(kwargs))

    handler = CallbackHandler([Replace, SeesTheReplacement()])
    handler.objects = {"model": None, "optimizer": None}
    control = handler.call("on_step_end", None, None, TrainerControl())
    assert control.should_save and SeesTheReplacement.seen == (True, ["model", "optimizer"])
    assert isinstance(handler.pop_callback(Replace), Replace) and len(handler.callbacks) == 1
    assert handler.pop_callback(Replace) is None
    with pytest.raises(TypeError, match="defines none of the events"):
        handler.add_callback(object())


# -- in a world of two ---------------------------------------------------------------------------------------------

class Events(TrainerCallback):
    """Every event with the step it came at; the logs and metrics it was handed."""

    def __init__(self):
        self.seen = []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            def record(args, state, control, **kwargs):
                extra = sorted((kwargs.get("logs") or kwargs.get("metrics") or {}).keys() & {"loss", "eval_loss"})
                if name == "on_prediction_step":
                    extra = [torch.is_grad_enabled()]  # after the batch's no_grad, as in Transformers
                self.seen.append((name, state.global_step, *extra))
            return record
        return object.__getattribute__(self, name)


class RankDecides(TrainerCallback):
    """Rank 0 asks for an evaluation at step 2, a save at step 3 and a stop at step 5; rank 1 asks for a stop when
    training begins, at step 1, and a save at every step. Only rank 0's requests may take effect, on both ranks
    (the arguments schedule no evaluation and no save)."""

    def __init__(self, rank):
        self.rank = rank

    def on_train_begin(self, args, state, control, **kwargs):
        control.should_training_stop = self.rank != 0  # rank 1 would not even start

    def on_step_end(self, args, state, control, **kwargs):
        if self.rank == 0:
            control.should_evaluate = state.global_step == 2
            control.should_save = state.global_step == 3
            control.should_training_stop = state.global_step == 5
        else:
            control.should_training_stop = True
            control.should_save = True


class ReadsWeights(TrainerCallback):
    """At each step's end (its gathers still in flight under stage 2): were they, and the weights it reads."""

    def __init__(self):
        self.seen = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        in_flight = any(type(p) is InFlight for p in model.parameters())
        self.seen.append((in_flight, [p.detach().clone() for p in model.parameters()]))


class StopInsideStep(TrainerCallback):
    def __init__(self, rank):
        self.rank = rank

    def on_substep_end(self, args, state, control, **kwargs):
        control.should_training_stop = self.rank == 0 and state.global_step == 1  # inside the second step


def _trainer(out, callbacks, n=24, **kw):
    torch.manual_seed(0)
    args = trainer_args(out, **{"per_device_train_batch_size": 2, "max_steps": 8, **kw})
    return Trainer(Classifier().double(), args, train_dataset=classification_data(n),
                   eval_dataset=classification_data(6, seed=1), callbacks=callbacks)


def callbacks_world(world, out):
    events = Events()
    trainer = _trainer(f"{out}/events", [events], eval_strategy="steps", eval_steps=4, save_strategy="steps",
                       save_steps=4)
    trainer.train()
    decides = _trainer(f"{out}/decides", [RankDecides(world.rank)])
    decides.train()
    decided = ([e["step"] for e in decides.state.log_history if "eval_loss" in e], decides.state.global_step,
               sorted(n for n in os.listdir(f"{out}/decides") if n.startswith("checkpoint-")))
    # A callback on rank 0 only: the ranks agree once that callbacks exist, then on the flags at every step.
    lonely = _trainer(f"{out}/lonely", [RankDecides(0)] if world.rank == 0 else [])
    lonely.train()
    accumulating = Events()
    _trainer(f"{out}/accumulating", [accumulating], max_steps=2, gradient_accumulation_steps=3,
             eval_strategy="steps", eval_steps=2).train()
    # A stop asked inside step 2 (on rank 0 only, after its first micro-batch) ends training when that step ends.
    inside = _trainer(f"{out}/inside", [StopInsideStep(world.rank)], max_steps=6, gradient_accumulation_steps=3)
    inside.train()
    # Stage 2 leaves its gathers in flight past the callbacks; one that reads the weights waits for them.
    reads = {stage: ReadsWeights() for stage in (0, 2)}
    for stage, callback in reads.items():
        _trainer(f"{out}/zero{stage}", [callback], ddp_zero_stage=stage, max_steps=4).train()
    waited = ([in_flight for in_flight, _ in reads[2].seen],
              max((a - b).abs().max().item() for (_, w0), (_, w2) in zip(reads[0].seen, reads[2].seen)
                  for a, b in zip(w0, w2)))
    return events.seen, decided, lonely.state.global_step, params_of(decides.model), accumulating.seen, \
        (inside.state.global_step, params_of(inside.model)), waited


def test_events_in_order_and_the_control_is_rank_zeros(tmp_path):
    results = run_world(callbacks_world, world_size=2, args=(str(tmp_path),))
    (seen0, decided0, lonely0, params0, acc0, in0, waited0), (seen1, decided1, lonely1, params1, acc1, in1, _) = results
    # In flight at every step's end, and read as they are after the step (a stale read is ~lr off, 1e-3).
    assert waited0[0] == [True] * 4 and waited0[1] <= 1e-12, waited0
    # Every event on every rank, at the same steps, but the prediction steps: evaluation hands out whole batches
    # of one process's (so that eval_loss is one process's), and the 6 samples are one batch, rank 0's.
    assert [e for e in seen0 if e[0] != "on_prediction_step"] == seen1
    names = [e[0] for e in seen0]
    assert names[:4] == ["on_init_end", "on_train_begin", "on_epoch_begin", "on_step_begin"]
    assert names[-1] == "on_train_end" and names.count("on_step_end") == 8 and names.count("on_save") == 2
    step4 = [e for e in seen0 if e[1] == 4 and e[0] != "on_prediction_step"]
    assert step4 == [("on_step_end", 4), ("on_log", 4, "loss"), ("on_log", 4, "eval_loss"),
                     ("on_evaluate", 4, "eval_loss"), ("on_save", 4), ("on_step_begin", 4),
                     ("on_pre_optimizer_step", 4), ("on_optimizer_step", 4)]
    # 6 evaluation samples: one batch of the default per_device_eval_batch_size (8) at steps 4, 8, on rank 0.
    assert [e[1:] for e in seen0 if e[0] == "on_prediction_step"] == [(4, True), (8, True)]
    # Accumulation over 3 micro-batches: Transformers' order of the events inside each step, on every rank.
    assert [e for e in acc0 if e[0] != "on_prediction_step"] == [e for e in acc1 if e[0] != "on_prediction_step"]
    inside = [e[0] for e in acc0 if e[0] not in ("on_init_end", "on_train_begin", "on_epoch_begin")]
    assert inside[:7] == ["on_step_begin", "on_substep_end", "on_substep_end", "on_pre_optimizer_step",
                          "on_optimizer_step", "on_step_end", "on_log"], inside
    # The stop rank 0 asked inside step 2 took effect on both ranks once that whole step (all 3 micro-batches,
    # so the all-reduces matched) was done, and the replicas agree.
    assert in0[0] == in1[0] == 2
    assert all((a == b).all() for a, b in zip(in0[1], in1[1]))
    # Rank 0's requests took effect on both ranks; rank 1's (stop at step 1, save at every step) did not.
    assert decided0 == decided1 == ([2], 5, ["checkpoint-3"])
    assert all((a == b).all() for a, b in zip(params0, params1))
    assert lonely0 == lonely1 == 5


def early_stopping_world(world, out):
    from transformers import EarlyStoppingCallback

    # Any change below the threshold is no improvement: the second evaluation (step 4) exhausts a patience of 1.
    trainer = _trainer(out, [EarlyStoppingCallback(early_stopping_patience=1, early_stopping_threshold=1e9)],
                       max_steps=20, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
                       load_best_model_at_end=True)
    trainer.train()
    return trainer.state.global_step, trainer.state.best_model_checkpoint, trainer.state.best_metric


def test_transformers_early_stopping_stops_every_rank_after_the_same_evaluation(tmp_path):
    pytest.importorskip("transformers")
    (step0, best0, metric0), (step1, best1, metric1) = run_world(early_stopping_world, world_size=2,
                                                                  args=(str(tmp_path),))
    assert step0 == step1 == 4
    assert best0 == best1 and best0 is not None and metric0 == metric1


class Counts(TrainerCallback):
    """A stateful callback (Transformers' ExportableState shape): how many evaluations it has seen, and a
    setting it was built with."""

    def __init__(self, every=1):
        self.evaluations, self.every = 0, every

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.evaluations += 1

    def state(self):
        return {"args": {"every": self.every}, "attributes": {"evaluations": self.evaluations}}


def test_stateful_callbacks_are_saved_and_restored_only_when_asked(tmp_path, local_world):
    schedule = dict(max_steps=4, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=2)
    first = Counts(every=3)
    _trainer(tmp_path / "run", [first], **schedule).train()
    assert first.evaluations == 4
    with open(tmp_path / "run" / "checkpoint-2" / "trainer_state.json") as f:
        saved = json.load(f)["stateful_callbacks"]
    control = {"should_training_stop": False, "should_epoch_stop": False, "should_save": True,
               "should_evaluate": False, "should_log": False}  # what a Transformers run saves there (checked)
    assert saved == {"Counts": {"args": {"every": 3}, "attributes": {"evaluations": 2}},
                     "TrainerControl": {"args": control, "attributes": {}}}
    # Resumed at step 2, evaluated at steps 3 and 4; restored, the callback is the one the script holds, built
    # again from its saved arguments, as Transformers restores it (its attributes alone came back before)
    for restore, expected in ((True, (4, 3)), (False, (2, 1))):
        again = Counts()
        trainer = _trainer(tmp_path / f"again-{restore}", [again], restore_callback_states_from_checkpoint=restore,
                           **schedule)
        trainer.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
        assert (again.evaluations, again.every) == expected and trainer.callback_handler.callbacks[-1] is again

    class Unbuildable(Counts):
        def state(self):
            return {"args": {"often": 2}, "attributes": {}}

    _trainer(tmp_path / "unbuildable", [Unbuildable()], **schedule).train()
    trainer = _trainer(tmp_path / "refused", [Unbuildable()], restore_callback_states_from_checkpoint=True, **schedule)
    with pytest.raises(TypeError, match="Unbuildable cannot be built again from the arguments its checkpoint saved"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "unbuildable" / "checkpoint-2"))


class OnLogDecides(TrainerCallback):
    """Rank 0's on_log asks for an evaluation at step 2, a save at step 3 and a stop at step 4; rank 1's asks for
    nothing. The flags are set after the step's own agreement, in the log that follows it."""

    def __init__(self, rank):
        self.rank = rank

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.rank == 0 and "loss" in (logs or {}):
            control.should_evaluate = control.should_evaluate or state.global_step == 2
            control.should_save = control.should_save or state.global_step == 3
            control.should_training_stop = state.global_step == 4


def on_log_world(world, out):
    trainer = _trainer(out, [OnLogDecides(world.rank)])
    trainer.train()
    return ([e["step"] for e in trainer.state.log_history if "eval_loss" in e], trainer.state.global_step,
            sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")))


def test_flags_set_in_on_log_on_rank_zero_take_effect_on_every_rank(tmp_path):
    # Before, they were never agreed: rank 0 evaluated alone (a collective mismatch) or stopped alone.
    assert run_world(on_log_world, world_size=2, args=(str(tmp_path),), collective_timeout_s=20,
                     stall_seconds=5) == [([2], 4, ["checkpoint-3"])] * 2


class SavesAfterEvaluation(TrainerCallback):
    """Rank 0's on_evaluate asks for a save at step 4, rank 1's at every evaluation."""

    def __init__(self, rank):
        self.rank = rank

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        control.should_save = self.rank == 1 or state.global_step == 4


def on_evaluate_world(world, out):
    _trainer(out, [SavesAfterEvaluation(world.rank)], eval_strategy="steps", eval_steps=2).train()
    return sorted(n for n in os.listdir(out) if n.startswith("checkpoint-"))


def test_a_save_asked_in_on_evaluate_is_made_after_that_evaluation(tmp_path):
    # Before, the save was decided (and the flags cleared) before the evaluation ran: no checkpoint at all.
    assert run_world(on_evaluate_world, world_size=2, args=(str(tmp_path),)) == [["checkpoint-4"]] * 2


def test_the_handler_has_transformers_event_methods_for_subclasses_that_call_them():
    class Seen(TrainerCallback):
        def __init__(self):
            self.got = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.got.append(logs)
            control.should_save = True

    seen = Seen()
    handler = CallbackHandler([seen])
    control = handler.on_log(None, None, TrainerControl(should_log=True), {"loss": 1.0})
    assert seen.got == [{"loss": 1.0}] and control.should_save and not control.should_log  # cleared, as there
    assert handler.on_save(None, None, TrainerControl(should_save=True)).should_save is False
    assert handler.on_step_begin(None, None, TrainerControl(should_evaluate=True)).should_evaluate is False
    assert handler.call_event("on_log", None, None, TrainerControl(), logs={"loss": 2.0}).should_save
    assert seen.got[-1] == {"loss": 2.0}
    with pytest.raises(TypeError, match=r"on_save takes \(args, state, control\)"):
        handler.on_save(None, None, TrainerControl(), 5)
    with pytest.raises(AttributeError, match="no attribute 'on_nothing'"):
        handler.on_nothing  # noqa: B018
