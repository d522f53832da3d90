"""Uneven inputs: ranks that ran out of data shadow the collectives of those still training (torch's join()).

    with model.join():                        # or torch's own: with Join([model, zero_optimizer]):
        for x, y in my_batches:               # the ranks may hold different numbers of batches
            loss_fn(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()

The contract is torch's (torch.distributed.algorithms.join, and its DistributedDataParallel). At each training
forward inside the context, a rank still training issues, before its module runs (`training_forward`):

    1. ranks still training   all-reduce of a one (a rank that ran out adds a zero): the divisor when
                              divide_by_initial_world_size=False. With throw_on_early_termination, a second
                              all-reduce says whether some rank ran out, and then every rank raises.
    2. buffer source          all-reduce MAX of the rank (a rank that ran out: -1): the highest-numbered rank
                              still training, whose buffers are then broadcast. As in torch, this holds from the
                              first iteration on, before any rank has run out: which rank runs out first is not
                              known in advance, and rank 0's buffers go stale once it has.
    3. backward synchronises  all-reduce of require_backward_grad_sync (a rank that ran out adds a zero)

and its backward issues the buckets and the usage counts (in the last bucket, or on their own: ddpkit.engine.reducer). A
rank that ran out runs `DDPJoinHook.main_hook` once per iteration of the others: the same collectives, under the
same names (so that the stall inspector sees one sequence on every rank), with zeros. Until the join ends its .grad
then hold what the ranks still training step with (their average, bit for bit; None for a parameter no rank
used), so that a ddpkit.ZeroRedundancyOptimizer joined beside the model (`Join([model, optimizer])`), whose hook
steps this rank's shard for the others, steps it with the right gradient; torch's wrapper leaves the joined rank's
stale gradient there. When the join ends, the .grad it had when it ran out are given back (torch's end state).
Accumulation (no_sync) with a ZeRO optimizer needs ddpkit's Join (`ddpkit.Join([model, optimizer])`), whose
optimizer hook steps only after a synchronised iteration; under torch's Join it steps at every iteration, as
torch's does, and the stall inspector reports the collectives' order mismatch.

Gradients: each rank divides its bucket by the divisor and the all-reduce sums the buckets; ranks that ran out add
zeros. So with divide_by_initial_world_size=True (the divisor stays the world size) a gradient is the sum over the
ranks still training divided by the initial world size: every sample weighs the same, whichever rank held it. With
False the divisor is the number of ranks still training: their mean, as a smaller world would compute it.

When every rank has run out, `post_hook` copies the model (its parameters, and its buffers when forward buffers
are synchronised) from the last rank to join, the highest-numbered one if several ran out last together.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.algorithms.join import Join as TorchJoin
from torch.distributed.algorithms.join import JoinHook, _JoinConfig

from ddpkit.distributed.comm import Comm, max_over_ranks
from ddpkit.engine.buckets import Bucket

# What the join collectives are called: the same on the ranks still training and on those that ran out.
STILL_TRAINING = "join: ranks still training"
SOMEONE_RAN_OUT = "join: has a rank run out of data"
BUFFER_SOURCE = "join: buffer source, the highest rank still training"
BACKWARD_SYNCS = "join: does this backward synchronise"
LAST_TO_JOIN = "join: the last rank to join"


class Join(TorchJoin):
    """torch's Join, whose own two collectives go through ddpkit's Comm (numbered and watched like every other);
    `DistributedDataParallel.join()` returns one. torch's Join itself works with ddpkit's wrapper as well."""

    def __init__(self, joinables: list[Any], enable: bool = True, throw_on_early_termination: bool = False,
                 **kwargs: Any):
        super().__init__(joinables, enable, throw_on_early_termination, **kwargs)
        self._comm = Comm.for_group(self._process_group)
        model_hook = None
        for hook in self._join_hooks:
            if isinstance(hook, DDPJoinHook):
                hook.counted_in_comm = True
                model_hook = model_hook or hook
            elif isinstance(hook, ZeroJoinHook):
                if model_hook is None and any(isinstance(h, DDPJoinHook) for h in self._join_hooks):
                    for joinable in joinables:  # as before this Join: usable outside any
                        joinable._join_config = _JoinConfig.construct_disabled_join_config()
                    raise ValueError("put the model before the ZeroRedundancyOptimizer in Join([model, "
                                     "optimizer]): the optimizer's hook steps with what the model's shadowed")
                hook.follows = model_hook  # steps only after a synchronised iteration (accumulation)

    def __enter__(self) -> Join:
        """Entered again (one Join around each epoch): the joinables' configs anew, which the model's post_hook
        turned off when the last join ended (so that forwards outside it issue no join collectives)."""
        self._set_joinable_configs()
        return self

    # torch's Join.__exit__ loops over these two while some rank still trains.
    def _get_num_nonjoined_procs(self) -> float:
        count = torch.zeros(1, device=self._device)  # this rank ran out: a zero beside the others' ones
        self._comm.all_reduce(count, STILL_TRAINING)
        return count.item()

    def _notify_procs_to_terminate(self) -> None:
        self._comm.all_reduce(torch.ones(1, device=self._device), SOMEONE_RAN_OUT)
        raise RuntimeError(f"Rank {self._rank} exhausted all inputs. It ran out of data inside "
                           "join(throw_on_early_termination=True), so every rank stops here")


def refuse_stage_2(stage_2: bool) -> None:
    """zero_stage=2 under a Join: refused when the Join asks for the hooks, on every rank before any collective
    (torch's Join asks even when disabled; the hook cannot know, so a disabled Join is refused too)."""
    if stage_2:
        raise NotImplementedError("join with zero_stage=2 is not supported yet: give every rank the same number "
                                  "of batches (ddpkit.DistributedSampler does), or use zero_stage=0")


def training_forward(ddp: Any) -> None:
    """Steps 1 to 3 of the module docstring, before a training forward of a rank still training inside join()."""
    comm, config, device = ddp._comm, ddp._join_config, ddp.join_device
    _wait_pending(ddp)
    if config.is_first_joinable:  # as in torch, only the first joinable tells the context it still trains
        count = torch.ones(1, device=device)
        pending = comm.all_reduce(count, STILL_TRAINING, async_op=True)
        if config.throw_on_early_termination:
            ran_out = torch.zeros(1, device=device)
            comm.all_reduce(ran_out, SOMEONE_RAN_OUT)
            if ran_out.item():
                comm.wait(pending)
                raise RuntimeError(f"rank {comm.rank}: detected at least one rank that exhausted its inputs "
                                   "inside join(throw_on_early_termination=True); throwing across all ranks")
        if ddp._join_divide_by_initial_world_size:
            ddp._join_pending.append(pending)  # waited at the next forward: no rank waits for it here
        else:
            comm.wait(pending)
            # Sum over the ranks still training / their number: their mean (see the module docstring).
            ddp.reducer.divisor = count.item()
    if ddp.will_sync_module_buffers():
        source = int(max_over_ranks(comm, comm.rank, BUFFER_SOURCE, device))
        comm.broadcast_tensors(ddp._buffers_to_sync, src=source, what="module buffers")
    syncs = torch.full((1,), float(bool(ddp.require_backward_grad_sync)), device=device)
    ddp._join_pending.append(comm.all_reduce(syncs, BACKWARD_SYNCS, async_op=True))


def _wait_pending(ddp: Any) -> None:
    """The asynchronous join collectives of the last forward (long complete: later ones on the group are)."""
    pending, ddp._join_pending = ddp._join_pending, []
    for work in pending:
        ddp._comm.wait(work)


class DDPJoinHook(JoinHook):
    """What a rank that ran out of data does for ddpkit's wrapper under a Join (see the module docstring)."""

    def __init__(self, ddp: Any, divide_by_initial_world_size: bool = True):
        self.ddp = ddp
        ddp._join_divide_by_initial_world_size = bool(divide_by_initial_world_size)
        self.divisor_before = None if ddp.reducer is None else ddp.reducer.divisor
        # torch's Join counts the ranks still training outside ddpkit's Comm; ddpkit's Join sets this.
        self.counted_in_comm = False
        self.stand_ins: list[Bucket] | None = None
        self.kept_grads: list[torch.Tensor | None] | None = None  # this rank's .grad when it ran out
        self.synced = True  # whether the iteration this rank shadowed last synchronised its backward

    def main_hook(self) -> None:
        """Shadow one training iteration of the ranks still training: steps 1 to 3, then the backward."""
        ddp = self.ddp
        if ddp.reducer is None:
            return
        comm, device = ddp._comm, ddp.join_device
        if not self.counted_in_comm:  # keep this rank's numbering of collectives the others'
            comm.note("all_reduce", STILL_TRAINING, 4)
        if ddp.will_sync_module_buffers():
            source = int(max_over_ranks(comm, -1, BUFFER_SOURCE, device))
            comm.broadcast_tensors(ddp._buffers_to_sync, src=source, what="module buffers")
        syncs = torch.zeros(1, device=device)
        comm.all_reduce(syncs, BACKWARD_SYNCS)
        sync = self.synced = syncs.item() > 0
        # As after a forward of its own: buffers are broadcast at the next iteration only after a synced one.
        ddp.require_forward_param_sync = sync
        if sync:
            self.shadow_backward()

    def shadow_backward(self) -> None:
        """What the reducer issues in one synchronised backward, in its order and under its names, with zeros."""
        reducer = self.ddp.reducer
        number = reducer.synced_passes + 1  # the others' reducer names this backward's collectives by it
        if reducer.learning:
            reducer.learn_without_gradients()  # the bucket order from rank 0, as in the others' first backward
        if self.stand_ins is None:
            # Zeroed buckets of the same layouts that are no parameter's .grad (gradient_as_bucket_view would
            # otherwise hand this rank the others' gradients), reduced the same way (a comm hook runs on them).
            self.stand_ins = [Bucket(b.layout, reducer.params, reducer.comm, b.reduction, b.public.is_last(),
                                     as_view=False, usage_numel=b.usage_numel) for b in reducer.buckets]
        with torch.no_grad():
            handles = []
            for bucket in self.stand_ins:
                bucket.storage.zero_()  # this rank used no parameter: zero usage flags too, where they ride
                handles.append(bucket.launch(number))
            usage_work, usage = None, None
            if not self.stand_ins[-1].usage_numel:  # the counts as their own collective: zeros beside the others'
                usage = torch.zeros(len(reducer.params), dtype=torch.int32, device=reducer.params[0].device)
            if usage is not None and not reducer.reduction.chains:
                usage_work = reducer.sum_usage(usage, number)
            results = [bucket.wait(handle) for bucket, handle in zip(self.stand_ins, handles)]
            if usage is not None and reducer.reduction.chains:  # after a hook's chained collectives, as the others
                usage_work = reducer.sum_usage(usage, number)
            if usage_work is not None:
                reducer.comm.wait(usage_work)
            counts = usage if usage_work is not None else self.stand_ins[-1].usage
            self._lend_average(results, (counts > 0).tolist())
        reducer.synced_passes += 1

    def _lend_average(self, results: list[Any], everywhere_used: list[bool]) -> None:
        """The others' average into this rank's .grad, as a rank still training holds it after zero_grad and
        backward: new tensors; for a parameter no rank used None, or zeros where this rank's .grad were tensors
        when it ran out (zero_grad(set_to_none=False)). The .grad it had then are kept aside and given back by
        post_hook, as torch leaves them (the next epoch must not add to these)."""
        params = self.ddp.reducer.params
        if self.kept_grads is None:
            self.kept_grads = [p.grad for p in params]
        for param in params:
            param.grad = None
        for bucket, result in zip(self.stand_ins, results):  # stand-ins are no bucket view: copies, not views
            bucket.write_back(result, everywhere_used)
        for param, kept in zip(params, self.kept_grads):  # unused everywhere: zeros after zero_grad(False)
            if param.grad is None and kept is not None:
                param.grad = torch.zeros_like(kept)

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank ran out: the model of the last rank to join (the highest-numbered one of a tie) everywhere."""
        ddp = self.ddp
        _wait_pending(ddp)
        ddp._join_config = _JoinConfig.construct_disabled_join_config()  # later forwards: no join collectives
        if ddp.reducer is None:
            return
        if self.kept_grads is not None:
            for param, grad in zip(ddp.reducer.params, self.kept_grads):
                param.grad = grad
            self.kept_grads = None
        ddp.reducer.divisor = self.divisor_before
        comm = ddp._comm
        source = int(max_over_ranks(comm, comm.rank if is_last_joiner else -1, LAST_TO_JOIN, ddp.join_device))
        comm.broadcast_tensors(ddp._module_states(ddp.forward_sync_buffers), src=source, what="join: final model")


class ZeroJoinHook(JoinHook):
    """What a rank that ran out of data does for a ddpkit.ZeroRedundancyOptimizer under a Join (torch's contract):
    at each iteration of the others it steps its shard with the .grad it holds and all-gathers it, as their
    step() does. With ddpkit's DDP in the same Join (before the optimizer) that .grad is the average the others
    step with (DDPJoinHook._lend_average); under torch's DDP it must be set by hand, as torch's rule is.

    Under ddpkit's Join (ddpkit.Join([model, optimizer])) it follows the model's hook: it steps only after an
    iteration whose backward synchronised, as the others step only then when they accumulate (no_sync). torch's
    Join cannot tell it, and it steps at every iteration there, as torch's does."""

    def __init__(self, zero: Any):
        super().__init__()
        self.zero = zero
        self.follows: DDPJoinHook | None = None  # set by ddpkit's Join

    def main_hook(self) -> None:
        if self.follows is None or self.follows.synced:
            self.zero.step()
