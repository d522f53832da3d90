"""ZeroRedundancyOptimizer: ZeRO stage 1, a drop-in for torch's class of that name.

    model = ddpkit.DistributedDataParallel(net)          # or torch's DistributedDataParallel
    opt = ddpkit.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    loss.backward(); opt.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()
    opt.consolidate_state_dict(to=0); full = opt.state_dict() if rank == 0 else None

    model = ddpkit.DistributedDataParallel(net, zero_stage=2)   # stage 2: gradients sharded too
    opt = ddpkit.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)   # finds the shards

Each rank's optimizer keeps state only for its 1/N of the elements. Where torch's class hands out whole
parameters (one large embedding leaves the shards unequal), the shards here are balanced to the element: flat
slices of the parameters, per param group and dtype (ddpkit.engine.partition). An elementwise optimizer (SGD,
Adam, AdamW, ...) stepping a slice computes exactly what it computes for those elements of the whole tensor, so
the parameters are bitwise those of the unsharded optimizer given the same gradients (float32, float64; in
bf16 and fp16 on the CPU a few elements near a slice's end may differ in the last bit, torch's vectorized kernels
rounding a tensor's scalar tail differently from its body, and a slice having a tail of its own), and so, after
the all-gather, every replica is identical, bit for bit, in every dtype. Optimizers that need a
tensor's shape (Adafactor, or any class not known to be elementwise) get whole parameters instead, balanced
greedily.

state_dict() after consolidate_state_dict(to) is torch's plain format (whole tensors, parameters numbered in
param-group order), the same as the unsharded optimizer's: load_state_dict takes either, on any world size.
Checkpoints that no rank has to hold whole are ddpkit.checkpoint.sharded's (save_checkpoint uses them).

Stage 2 (DistributedDataParallel(zero_stage=2), see ddpkit.engine.sharded_grads): the wrapper reduce-scatters each bucket
into this rank's shard during backward and drops the local .grad; this class then partitions by the reducer's
buckets (built at the first step, after the first backward), steps on the shards and leaves the all-gathers of
the updated parameters in flight until the parameters are first read (ddpkit.engine.params_in_flight).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Joinable, JoinHook

from ddpkit.distributed.comm import Comm
from ddpkit.engine.join import ZeroJoinHook, refuse_stage_2
from ddpkit.engine.partition import chunk_positions, partition_flat, partition_whole, place_empty
from ddpkit.engine.sharded_grads import grad_shards_of, refuse_blind_scaler, unit_plan
from ddpkit.zero.local_optimizer import ELEMENTWISE, copy_down, copy_up, foreach_tensors, gets_whole_parameters, name_of
from ddpkit.zero.optimizer_state import local_state_dict, slice_state, whole_pieces, whole_state_dict
from ddpkit.zero.unit import Unit, clip_shards_, step_units


class ZeroRedundancyOptimizer(torch.optim.Optimizer, Joinable):
    """Wraps `optimizer_class(**defaults)` so that each rank keeps the state of its shard only.

    The arguments are torch's. parameters_as_bucket_view=True moves the parameters of each param group and
    dtype into one flat buffer (they become views of it) that the all-gather fills directly, saving a copy of
    the parameters per step. overlap_with_ddp is torch's name for stage 2, which ddpkit chooses on its
    DistributedDataParallel instead (zero_stage=2): passing True here is an error that says so.
    """

    def __init__(self, params: Iterable[Any], optimizer_class: type[torch.optim.Optimizer],
                 process_group: dist.ProcessGroup | None = None, parameters_as_bucket_view: bool = False,
                 overlap_with_ddp: bool = False, **defaults: Any):
        if overlap_with_ddp:
            raise ValueError("overlap_with_ddp=True is torch's stage-2 hook-up; in ddpkit stage 2 is chosen on "
                             "the model: ddpkit.DistributedDataParallel(module, zero_stage=2), with this "
                             "optimizer built on its parameters and overlap_with_ddp left False")
        whole = gets_whole_parameters(optimizer_class)
        self._built = False
        super().__init__(params, defaults)
        Joinable.__init__(self)
        self.optimizer_class = optimizer_class
        self._kwargs = defaults
        self.process_group = process_group
        self.comm = Comm.for_group(process_group)
        self.world_size, self.rank = self.comm.world_size, self.comm.rank
        self.global_rank, self.initialized, self._overlap_with_ddp = self.comm.global_rank(self.rank), True, False
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self.whole = whole
        self.units: list[Unit] = []
        self._slot_of: dict[int, tuple[int, int, int]] = {}  # id(local tensor) -> (parameter, start, stop)
        self._consolidated: dict[str, Any] | None = None
        self._fresh = True  # never stepped nor loaded: its whole state is empty, on every rank
        self._pending_load: Callable[[], None] | None = None  # stage 2: a load that waits for the shards
        self._hyper_loaded = False  # that load's hyperparameters are in param_groups already
        self._pending_pieces: list = []  # what that load holds: saved again by a save before the first step
        self.optim: torch.optim.Optimizer | None = None
        self._foreach_ok: list[bool] = []  # per local param group: zero_local.foreach_tensors
        self.grad_shards = grad_shards_of(self._numbered())
        if self.grad_shards is None:
            self._build([self._shard_group(index) for index in range(len(self.param_groups))])
        else:
            if self.whole:
                raise ValueError(f"{name_of(optimizer_class)} needs whole tensors, but zero_stage=2 gives each "
                                 "rank flat slices of the buckets; use it with zero_stage=0 (this class is stage 1)")
            # The shards are the reducer's buckets', known after the first synchronised backward: built then.
            self.grad_shards.consumer = self
            self._step_supports_amp_scaling = True  # torch's GradScaler, blind to the shards, then reaches step()
            self._adopt_defaults(optimizer_class([torch.zeros(1, requires_grad=True)], **defaults))
        self._built = True

    def _build(self, local_groups: list[dict[str, Any]]) -> None:
        self.optim = self.optimizer_class(local_groups, **self._kwargs)
        self._foreach_ok = [foreach_tensors(group["params"]) for group in self.optim.param_groups]
        self._adopt_defaults(self.optim)

    def _adopt_defaults(self, optim: torch.optim.Optimizer) -> None:
        """The wrapped optimizer's defaults fill in what the caller left out, so param_groups and state_dict
        read exactly as the unsharded optimizer's (schedulers change lr here; step copies it down)."""
        self.defaults = dict(optim.defaults)
        for group in self.param_groups:
            for key, value in optim.defaults.items():
                group.setdefault(key, value)

    # -- sharding -------------------------------------------------------------------------------------------------
    def _shard_group(self, index: int, skip: frozenset[int] = frozenset()) -> dict[str, Any]:
        """Partition one param group among the ranks (but the parameters whose id is in `skip`); the local
        optimizer's group for this rank's share.

        The memory this saves, in the ZeRO paper's accounting for Ψ parameters trained with mixed-precision
        Adam: 2Ψ bytes of fp16 weights + 2Ψ of fp16 gradients + KΨ of optimizer state, K = 12 (an fp32 copy
        of the weights, momentum and variance, 4 bytes each): 16Ψ per replica. Stage 1 (this class) keeps
        only 1/N of the KΨ term on each rank: 2Ψ + 2Ψ + 12Ψ/N. Stage 2 (DistributedDataParallel's
        zero_stage=2) also keeps 1/N of the gradients: 2Ψ + (2Ψ + 12Ψ)/N. Stage 3 (FSDP) would shard the
        weights too, 16Ψ/N; ddpkit does not. Each rank here owns ceil(n / N) elements of every unit of n
        elements (the last ranks what is left), so its share is 1/N of the total to within N elements per
        unit (param group and dtype); AdamW in fp32, as in the tests, keeps 8 bytes per element.
        """
        group = self.param_groups[index]
        first = sum(len(g["params"]) for g in self.param_groups[:index])
        by_kind: dict[tuple, list[int]] = {}
        for position, param in enumerate(group["params"]):
            if id(param) in skip:
                continue
            # A flat slice is a view only of a contiguous parameter: one that is not (channels_last, a transpose)
            # goes whole to one rank, whose optimizer steps it as it is (torch's class partitions so always).
            whole = self.whole or not (param.is_contiguous() or self.parameters_as_bucket_view)
            by_kind.setdefault((param.dtype, param.device, whole), []).append(position)
        local: list[torch.Tensor] = []
        for (*_, whole), same in by_kind.items():
            for positions in chunk_positions(group["params"], same):
                local += self._add_unit(index, first, positions, partition_whole if whole else partition_flat)
        options = {key: value for key, value in group.items() if key != "params"}
        return {**options, "params": local}

    def _add_unit(self, index: int, first: int, positions: list[int], cut: Callable) -> list[torch.Tensor]:
        """A unit of param group `index`'s parameters at `positions`, cut among the ranks; its local tensors."""
        group = self.param_groups[index]
        params = [group["params"][p] for p in positions]
        unit = Unit(f"group {index}", [first + p for p in positions], params, [index] * len(params),
                    cut([p.numel() for p in params], self.world_size), self.comm, self.parameters_as_bucket_view)
        self.units.append(unit)
        for piece, tensor in zip(unit.mine, unit.locals):
            self._slot_of[id(tensor)] = (unit.indices[piece.param], piece.start, piece.stop)
        return unit.locals

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's: the new group is partitioned among the ranks on its own (existing shards do not move)."""
        if self._built and self.grad_shards is not None:  # refused before anything changed, as torch's
            raise NotImplementedError("add_param_group under zero_stage=2 is not supported: pass every param "
                                      "group to the constructor")
        super().add_param_group(param_group)
        sparse = next((p for p in self.param_groups[-1]["params"] if p.layout != torch.strided), None)
        if sparse is not None:  # torch's type; its flat slices would be of no storage
            self.param_groups.pop()
            raise ValueError(f"ZeroRedundancyOptimizer only supports dense parameters, got a {sparse.layout} one "
                             f"of shape {tuple(sparse.shape)}: step it with an optimizer of its own")
        self._consolidated = None  # gathered for fewer groups: consolidate again
        if self._built:
            self.optim.add_param_group(self._shard_group(len(self.param_groups) - 1))
            self._foreach_ok.append(foreach_tensors(self.optim.param_groups[-1]["params"]))
            self._adopt_defaults(self.optim)

    # -- the step -------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:
        """Step this rank's shard, then all-gather the updated shards so every replica is whole and identical.
        kwargs go to the wrapped optimizer's step (torch's), which then runs once for all units on every rank;
        so does the closure there at stage 1, as torch's hands it over (else it is evaluated here, first)."""
        config = self._join_config
        if config.enable and config.is_first_joinable:  # it would have to tell the Join that this rank still trains
            self._join_config = config.construct_disabled_join_config()  # usable again outside any Join
            raise RuntimeError("a ZeroRedundancyOptimizer cannot be the first joinable of a Join: the first one "
                               "says at each iteration that its rank still trains, which the model's forward does; "
                               "write Join([model, optimizer])")
        refuse_blind_scaler(self)
        loss = None
        one_step = any(u.plan.whole for u in self.units) or bool(kwargs) or self.optimizer_class not in ELEMENTWISE
        handed = closure if one_step and self.grad_shards is None else None
        if closure is not None and handed is None:
            with torch.enable_grad():
                loss = closure()
        self._ensure_built()
        for unit in self.units:
            unit.follow(self.units)
        chosen = copy_down(self.optimizer_class, self.param_groups, self.optim.param_groups, self._foreach_ok)
        self._consolidated, self._fresh = None, False
        started, returned = step_units(self.optim, self.units, self.grad_shards is not None, one_step, kwargs,
                                       handed)
        for unit, handle in started:
            if self.grad_shards is not None and unit.index >= 0:
                self.grad_shards.add_gather(unit.index, unit, handle)  # waited for by the next forward
            else:
                unit.finish_gather(handle)
        copy_up(self.param_groups, self.optim.param_groups, chosen)
        if self.grad_shards is not None:
            self.grad_shards.stepped_on()
        return loss if returned is None else returned  # torch's returns what the wrapped step returned

    def wait_for_params(self) -> None:
        """Stage 2: wait for every parameter all-gather the last step left in flight. Reads through torch
        functions wait by themselves (ddpkit.engine.params_in_flight); this is for code that reads a parameter's memory some
        other way (a C extension, a view made before the step). (Stage 1 gathers within step().)"""
        if self.grad_shards is not None:
            self.grad_shards.wait_all()

    def zero_grad(self, set_to_none: bool = True) -> None:
        with torch._C.DisableTorchFunctionSubclass():  # clearing .grad reads no value: in-flight gathers go on
            super().zero_grad(set_to_none)
        if self.grad_shards is not None:
            self.grad_shards.zero_grad(set_to_none)

    def _ensure_built(self) -> None:
        if self.grad_shards is not None:
            self.grad_shards.wait_all()
            if self.optim is None:
                self._shard_buckets()

    def _shard_buckets(self) -> None:
        """Stage 2: one unit per bucket of the reducer, this rank owning the bucket's shard it reduced into."""
        shards = self.grad_shards
        if not shards.buckets:
            raise RuntimeError("zero_stage=2: step() came before any synchronised backward pass, where the "
                               "gradient shards are made; run forward and backward first")
        number = {id(p): i for i, p in enumerate(self._numbered())}
        group_of = {id(p): g for g, group in enumerate(self.param_groups) for p in group["params"]}
        local: list[list[torch.Tensor]] = [[] for _ in self.param_groups]
        for index in sorted(shards.buckets):
            bucket = shards.buckets[index]
            indices = [number.get(id(p)) for p in bucket.params]
            groups = [group_of.get(id(p)) for p in bucket.params]
            plan = place_empty(unit_plan(bucket.layout))  # a parameter of 0 elements steps on one rank too
            unit = Unit(f"bucket {index}", indices, bucket.params, groups, plan, self.comm,
                        False, functools.partial(shards.piece_grad, index), index=index)
            self.units.append(unit)
            for piece, tensor in zip(unit.mine, unit.locals):
                if indices[piece.param] is not None:  # not a parameter of this optimizer: never stepped
                    self._slot_of[id(tensor)] = (indices[piece.param], piece.start, piece.stop)
                    local[groups[piece.param]].append(tensor)
        # Parameters of this optimizer in no bucket (outside the wrapper, or ignored by it): stepped as at stage 1,
        # each owner with its slice of their own .grad (not averaged: the wrapper never saw them), then gathered.
        bucketed = frozenset(id(p) for bucket in shards.buckets.values() for p in bucket.params)
        for index in range(len(self.param_groups)):
            local[index] += self._shard_group(index, bucketed)["params"]
        self._build([{**{k: v for k, v in group.items() if k != "params"}, "params": params}
                     for group, params in zip(self.param_groups, local)])
        if self._pending_load is not None:
            pending, self._pending_load, self._pending_pieces = self._pending_load, None, []
            pending()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over every parameter of this optimizer, computed from the shards.

        Each rank takes the norm of the gradient elements its optimizer reads, the ranks combine them (a sum of
        p-th powers; for +-inf the largest or smallest, a NaN kept): 1/N of the work, one number each of
        communication. At stage 2 each rank scales its shards (all it holds); at stage 1 every .grad, which every
        rank holds averaged, so that they stay alike on every rank. The norm may differ from torch's in its last
        bit (a sum over pieces, where torch takes the norm of each tensor's norm). Returns the total norm (the same
        on every rank)."""
        self._ensure_built()
        return clip_shards_(self.units, self.comm, max_norm, norm_type, whole=self.grad_shards is None)

    # -- torch's Joinable: Join([model, optimizer]) for uneven inputs ---------------------------------------------
    def join_hook(self, **kwargs: Any) -> JoinHook:
        refuse_stage_2(self.grad_shards is not None)
        return ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._numbered()[0].device

    @property
    def join_process_group(self) -> Any:
        return self.comm.pg  # the group itself, as the model's: Join refuses joinables of different groups

    # -- state ----------------------------------------------------------------------------------------------------
    def _numbered(self) -> list[torch.nn.Parameter]:
        return [p for group in self.param_groups for p in group["params"]]

    def shard_state(self) -> list[tuple[int, int, int, dict[str, Any]]]:
        """This rank's optimizer state as [(parameter index, start, stop, state)]: flat element ranges of the
        parameters (numbered in param-group order), readable by any world size."""
        if self.optim is None:  # stage 2 before its first step: no state yet, but a load's, rank by rank 1/N of it
            return self._pending_pieces[self.rank::self.world_size]
        out = []
        for group in self.optim.param_groups:
            for tensor in group["params"]:
                state = self.optim.state.get(tensor)
                if state:
                    out.append((*self._slot_of[id(tensor)], dict(state)))
        return out

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's shard state on rank `to` (call it on every rank); then `state_dict()` there."""
        # On the CPU, as torch's class keeps it: a pickled CUDA tensor comes back on the device it left (another
        # rank's GPU, perhaps not visible here), and the pieces of one parameter must meet on one device.
        mine = [(*slot, {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()})
                for *slot, state in self.shard_state()]
        shards = self.comm.gather_object(mine, dst=to, what="zero consolidate_state_dict")
        if self.rank != to:
            self._consolidated = None
            return
        self._consolidated = whole_state_dict([piece for shard in shards for piece in shard], self._numbered(),
                                              self.param_groups, self.whole)

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer state in torch's format, on the rank that consolidate_state_dict gathered it to."""
        if self._consolidated is None and self._fresh:  # empty: nothing to gather (accelerate's prepare reads it)
            return whole_state_dict([], self._numbered(), self.param_groups, self.whole)
        if self._consolidated is None and not self.comm.distributed:
            self.consolidate_state_dict(to=self.rank)
        if self._consolidated is None:
            raise RuntimeError("the optimizer state is sharded: call consolidate_state_dict(to=rank) on every "
                               "rank first (after the last step), then state_dict() on that rank")
        return self._consolidated

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole state dict (this class's or the unsharded optimizer's); each rank keeps its slices."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(saved["params"]) != len(mine["params"]) for saved, mine in zip(groups, self.param_groups)):
            raise ValueError("the state dict's param groups do not match this optimizer's: "
                             f"{[len(g['params']) for g in groups]} parameters per group there, "
                             f"{[len(g['params']) for g in self.param_groups]} here")
        if self.optim is None:  # stage 2 before its first step: loaded when the shards are known
            pieces = whole_pieces(state_dict["state"], [p.shape for p in self._numbered()])
            self.defer_load(functools.partial(self.load_state_dict, state_dict), pieces, groups)
            return
        saved = state_dict["state"]
        pieces = []
        params = self._numbered()
        for index, start, stop in self._slot_of.values():
            whole = saved.get(index, saved.get(str(index)))
            if whole:
                pieces.append((index, start, stop, slice_state(whole, start, stop, params[index].shape, self.whole)))
        self.load_shard_state(pieces, groups)

    def wanted_ranges(self) -> list[tuple[int, int, int]]:
        """The (parameter index, start, stop) ranges whose state this rank keeps (empty until built)."""
        return list(self._slot_of.values())

    def defer_load(self, load: Callable[[], None], pieces: list | None = None,
                   param_groups: list[dict[str, Any]] | None = None) -> bool:
        """Stage 2 before the first step does not know its shards yet: run `load` once it does. False (and
        nothing deferred) when the shards are known. pieces: the saved pieces `load` reads, [(parameter index,
        start, stop, state)], which shard_state returns meanwhile (a save before the first step keeps them).
        param_groups: the saved hyperparameters, in param_groups at once, as an unsharded load puts them (a
        scheduler made after the load reads them, a learning rate set by hand after it stays)."""
        if self.optim is not None:
            return False
        self._pending_load, self._pending_pieces, self._fresh = load, list(pieces or ()), False
        if param_groups is not None:
            self._set_hyperparameters(param_groups)
            self._hyper_loaded = True  # the deferred load must not set them again over later changes
        return True

    def _set_hyperparameters(self, param_groups: list[dict[str, Any]]) -> None:
        for group, saved in zip(self.param_groups, param_groups):
            group.update({key: value for key, value in saved.items() if key not in ("params", "count")})

    def load_shard_state(self, pieces: list[tuple[int, int, int, dict[str, Any]]],
                         param_groups: list[dict[str, Any]]) -> None:
        """Load exactly this rank's pieces [(parameter index, start, stop, state)] and the hyperparameters;
        per-element tensors may come flat (ddpkit.checkpoint.sharded writes them so)."""
        self._fresh = False
        if not self._hyper_loaded:
            self._set_hyperparameters(param_groups)
        self._hyper_loaded = False
        local_state, local_groups = local_state_dict(pieces, self.param_groups, self.optim.param_groups,
                                                     lambda tensor: self._slot_of[id(tensor)])
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
        self._consolidated = None

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (tensors in its local optimizer's state)."""
        if self.optim is None:
            return 0
        return sum(v.numel() * v.element_size() for state in self.optim.state.values() for v in state.values()
                   if isinstance(v, torch.Tensor))
