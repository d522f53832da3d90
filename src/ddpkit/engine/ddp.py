"""DistributedDataParallel: a drop-in for torch's wrapper, on ddpkit's own reducer.

    world = ddpkit.init_process_group()
    model = ddpkit.DistributedDataParallel(net.to(world.device), device_ids=[world.device.index] if cuda else None)
    loss = model(x).loss_fn(...); loss.backward()      # gradients averaged over every rank
    with model.no_sync():                              # accumulate locally, reduce on the next synced backward
        model(x2).sum().backward()

What differs from torch's: a parameter that gets no gradient never hangs and never lets replicas diverge,
whatever `find_unused_parameters` says (see `Reducer`); `find_unused_parameters=True` only adds a walk of the
autograd graph after each forward, so that buckets of parameters the forward did not reach are launched during
backward, not at its end (custom autograd Functions, reentrant checkpointing among them, count as reaching
every parameter). Two backwards after two forwards, and layers used several times under reentrant activation
checkpointing, give the gradients one process would compute.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import _JoinConfig
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ddpkit.distributed.comm import Comm
from ddpkit.engine import checks
from ddpkit.engine.forward_io import move_to, tensors_in
from ddpkit.engine.join import Join, refuse_stage_2, training_forward
from ddpkit.engine.reducer import HOOK_ONCE, CommHook, Reducer
from ddpkit.engine.sharded_grads import GradShards, check_zero_stage
from ddpkit.engine.torch_surface import TorchSurface, install_refusals
from ddpkit.timeline.record import FORWARD, NULL_RECORDER
from ddpkit.timeline.recorder import recorder_for


class DistributedDataParallel(TorchSurface, TorchDDP):
    """Replicates `module` on every rank and averages its gradients during backward.

    The arguments are torch's, in torch's order, with the same meanings and defaults; `check_reduction`,
    `static_graph`, `batched_grad_copy` and `skip_all_reduce_unused_params` are accepted for compatibility and
    change nothing (unused parameters and reentrant checkpointing are always handled, small gradients are always
    copied into their bucket together; see the module docstring). `delay_all_reduce_named_params`,
    `param_to_hook_all_reduce`, `mixed_precision` and `bucket_cap_mb_list` raise NotImplementedError.

    It subclasses torch's wrapper only so that code which asks `isinstance(model, DistributedDataParallel)`
    (accelerate's and the Transformers Trainer's unwrapping, torch.distributed.checkpoint) treats it as one;
    none of torch's engine runs: its constructor is skipped and every torch method is ours, refused with a
    clear error, or one that needs none of torch's fields (see ddp_surface).
    """

    def __init__(self, module: nn.Module, device_ids: list[int | torch.device] | None = None,
                 output_device: int | torch.device | None = None, dim: int = 0,
                 broadcast_buffers: bool | None = None, init_sync: bool = True,
                 process_group: dist.ProcessGroup | None = None, bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 delay_all_reduce_named_params: Any = None, param_to_hook_all_reduce: Any = None,
                 mixed_precision: Any = None, device_mesh: Any = None, skip_all_reduce_unused_params: bool = False,
                 bucket_cap_mb_list: list[int] | None = None, batched_grad_copy: bool = False,
                 forward_sync_buffers: bool | None = None, *, zero_stage: int = 0):
        nn.Module.__init__(self)  # not torch's constructor: its reducer is exactly what we replace
        # The checks come in torch's order, so that a module with several problems gets torch's first error.
        process_group = checks.process_group_of(process_group, device_mesh)
        checks.refuse_torch_only(delay_all_reduce_named_params, param_to_hook_all_reduce, mixed_precision,
                                 bucket_cap_mb_list)
        self.parameters_to_ignore = checks.names_to_ignore(module)
        named = checks.trainable_parameters(module, self.parameters_to_ignore)
        self.device_ids, self.output_device = checks.devices(named, device_ids, output_device)
        self.module = module
        self.dim = dim
        self.forward_sync_buffers, sync_buffers_at_init = checks.buffer_sync(broadcast_buffers, forward_sync_buffers)
        self.find_unused_parameters = find_unused_parameters
        checks.warn_check_reduction(check_reduction)
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = False  # True below, through _set_static_graph (torch's warning included)
        self.bucket_cap_mb = checks.bucket_cap(bucket_cap_mb)
        self.bucket_bytes_cap = int(self.bucket_cap_mb * 1024 * 1024)  # torch's name; torch.compile reads it
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.process_group = process_group
        if device_mesh is not None:
            self.device_mesh = device_mesh  # torch's wrapper has the attribute only when given one
        self.zero_stage = check_zero_stage(zero_stage)  # ddpkit's: 2 shards the gradients (ddpkit.engine.sharded_grads)
        checks.no_sync_batchnorm_on_cpu(module, named)
        self._build_engine(init_sync, sync_buffers_at_init)
        if static_graph:
            self._set_static_graph()

    def _named_trainable(self) -> list[tuple[str, nn.Parameter]]:
        return checks.trainable_parameters(self.module, self.parameters_to_ignore)

    def _build_engine(self, init_sync: bool, sync_buffers_at_init: bool) -> None:
        """Everything tied to the process group: built at construction and again when unpickled (with
        init_sync=False then: loading must not need the other ranks, as with torch's wrapper)."""
        self._comm = Comm.for_group(self.process_group)
        self._training_forwards = 0  # with grad and require_backward_grad_sync (_set_static_graph's check)
        self.reducer: Reducer | None = None
        self._join_config = _JoinConfig.construct_disabled_join_config()  # a Join context sets it (ddpkit.engine.join)
        self._join_divide_by_initial_world_size = True
        self._join_pending: list = []
        self._grad_shards = None
        if not self._comm.distributed:
            return
        if init_sync:
            checks.check_same_model(self.module, self._comm, self.parameters_to_ignore)
            self._comm.broadcast_tensors(self._module_states(sync_buffers_at_init), src=0,
                                         what="init parameters and buffers")
        named = self._named_trainable()
        # zero_stage=2: each bucket is reduce-scattered into this rank's shard, which is all it keeps.
        self._grad_shards = GradShards(self.module, [p for _, p in named], self._comm) if self.zero_stage == 2 \
            else None
        self.reducer = Reducer([p for _, p in named], [n for n, _ in named], self._comm, self.bucket_cap_mb,
                               self.gradient_as_bucket_view, default_sync=self._unarmed_sync,
                               reduction=self._grad_shards.reduction if self._grad_shards else None)
        self.reducer.recorder = recorder_for(self._comm)  # the timeline, when one records (else a no-op)
        self._param_index = {id(p): i for i, (_, p) in enumerate(named)}
        self._forward_sync = (False, -1)  # (the last forward's decision, reducer.armed then): none yet
        self._reached: set[int] = set()
        self._reached_pass = -1

    def _module_states(self, buffers: bool) -> list[torch.Tensor]:
        """What makes the replicas one model: the parameters (and buffers), less the ignored ones."""
        ignore = self.parameters_to_ignore
        tensors = [p.detach() for n, p in self.module.named_parameters() if n not in ignore]
        if buffers:
            tensors += [b for n, b in self.module.named_buffers() if n not in ignore]
        return tensors

    # -- torch's attributes ----------------------------------------------------------------------------------------
    @property
    def forward_sync_buffers(self) -> bool:
        """Whether buffers come from rank 0 at each training forward (torch 2.13's name; settable)."""
        return self._forward_sync_buffers

    @forward_sync_buffers.setter
    def forward_sync_buffers(self, value: bool) -> None:
        self._forward_sync_buffers = bool(value)
        self._buffers_seen = len(self._buffers_to_sync)

    @property
    def _buffers_to_sync(self) -> list[torch.Tensor]:
        """The buffers rank 0 sends, read from the module at each broadcast, as torch's wrapper reads them: one
        reassigned in forward (self.ema = ...), registered after wrapping or converted (ddp.double()) is a new
        tensor, which a list taken once would never send. How many there were is kept for
        will_sync_module_buffers (torch's len(modules_buffers)), so that a forward walks the module once."""
        if not self._forward_sync_buffers:
            return []
        ignore = self.parameters_to_ignore
        buffers = [b for n, b in self.module.named_buffers() if n not in ignore]
        self._buffers_seen = len(buffers)
        return buffers

    @property
    def broadcast_buffers(self) -> bool:
        """torch's deprecated name for forward_sync_buffers."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    # -- pickling, torch.save, copy.deepcopy: torch's contract ------------------------------------------------------
    _ENGINE_STATE = ("_comm", "process_group", "reducer", "_param_index", "_reached", "_reached_pass",
                     "_join_config", "_join_pending", "_grad_shards")

    def __getstate__(self) -> dict[str, Any]:
        """The module and the settings; the process group and the reducer are rebuilt by __setstate__."""
        self._check_default_group()
        return {k: v for k, v in self.__dict__.items() if k not in self._ENGINE_STATE}

    def _check_default_group(self) -> None:
        if self.process_group is not None and self.process_group is not _default_group():
            raise RuntimeError("a DistributedDataParallel wrapper can be pickled only over the default process "
                               "group (process_group=None); pickle or save `model.module` instead")

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild on the default process group (a world of one without any), without a collective."""
        nn.Module.__setstate__(self, state)
        self.process_group = None
        self.forward_sync_buffers = self._forward_sync_buffers  # counts the buffers (an older pickle has no count)
        self._build_engine(init_sync=False, sync_buffers_at_init=False)

    # -- the forward skeleton ------------------------------------------------------------------------------------
    # Dynamo does not trace the wrapper itself (its collectives and graph hooks are eager work, as in torch's,
    # whose file Dynamo skips): the skeleton's frames are skipped and its helpers run eagerly with all they call,
    # so that torch.compile(ddp) compiles the wrapped module's call alone (tracing the helpers recompiled or
    # re-traced them at every step: 200 ms a step with find_unused_parameters).
    @torch._disable_dynamo(recursive=False)
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        recorder = self.reducer.recorder if self.reducer is not None else NULL_RECORDER
        with recorder.span(FORWARD, "forward"):  # also torch's record_function of that name, under a profiler
            inputs, kwargs = self._pre_forward(inputs, kwargs)
            output = self._run_ddp_forward(*inputs, **kwargs)
            return self._post_forward(output)

    @contextlib.contextmanager
    @torch._disable_dynamo(recursive=False)
    def _inside_ddp_forward(self) -> Iterator[None]:
        """While the wrapped module runs, torch's class names this wrapper as the active DDP module: Dynamo reads
        it (and its bucket_bytes_cap) when it compiles a frame, and then lets its DDPOptimizer split the graph at
        bucket boundaries, so that a compiled backward is several autograd nodes and buckets launch between
        them. The attribute lives on torch's class because that is where Dynamo looks; nesting restores it."""
        previous = TorchDDP._active_ddp_module
        TorchDDP._active_ddp_module = self if self.bucket_bytes_cap >= DYNAMO_FIRST_BUCKET_BYTES \
            else _SplitForDynamo(DYNAMO_FIRST_BUCKET_BYTES)
        try:
            yield
        finally:
            TorchDDP._active_ddp_module = previous

    @torch._disable_dynamo(recursive=False)
    def _run_ddp_forward(self, *inputs: Any, **kwargs: Any) -> Any:
        # zero_stage=2: the parameters the last step gathered, each bucket waited for when first read.
        reads = self._grad_shards.forward_reads() if self._grad_shards is not None else contextlib.nullcontext()
        with self._inside_ddp_forward(), reads:
            return self.module(*inputs, **kwargs)

    @torch._disable_dynamo
    def _pre_forward(self, inputs: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.device_ids:
            device = torch.device("cuda", self.device_ids[0])
            inputs, kwargs = move_to(inputs, device), move_to(kwargs, device)
        self._training_forwards += torch.is_grad_enabled() and self.require_backward_grad_sync
        if not torch.is_grad_enabled() or self.reducer is None:
            # torch's rule, grad or not: the forward after a synchronised one takes rank 0's buffers, so an
            # evaluation after training runs on the statistics every rank shares (to evaluate on one rank only,
            # call model.module, as with torch's wrapper: here the mismatch would end the job, named).
            if self.reducer is not None and not self._join_config.enable and self.will_sync_module_buffers():
                self._comm.broadcast_tensors(self._buffers_to_sync, src=0, what="module buffers")
            return inputs, kwargs
        if self._join_config.enable:
            training_forward(self)  # what ranks that ran out of data shadow; buffers from the highest rank
        elif self.will_sync_module_buffers():
            # Running statistics and the like come from rank 0 after a synchronised forward (torch's
            # require_forward_param_sync): under no_sync only the first micro-batch pays the broadcast.
            self._comm.broadcast_tensors(self._buffers_to_sync, src=0, what="module buffers")
        return inputs, kwargs

    @torch._disable_dynamo
    def _post_forward(self, output: Any) -> Any:
        if not torch.is_grad_enabled():
            self.require_forward_param_sync = False  # torch's: the next forward keeps its own buffers
            return output
        # torch's rule: buffers are broadcast before the next forward only if this one will synchronise.
        self.require_forward_param_sync = self.require_backward_grad_sync
        if self.reducer is None:
            return output
        sync = self.require_backward_grad_sync  # decided here, at forward time, as torch's wrapper does
        tensors = [t for t in tensors_in(output) if t.requires_grad]
        nodes = {t.grad_fn for t in tensors if t.grad_fn is not None}
        self._forward_sync = (sync, self.reducer.armed)  # for a backward no output below arms (_unarmed_sync)
        if not nodes:
            return output  # nothing to arm: the first gradient hook opens the backward pass instead
        if sync and self.find_unused_parameters:
            self._note_reachable(tensors)
        # A pre-hook on the nodes that produced the outputs runs first in the backward that uses them, in the
        # outermost graph task, and costs no copy: the outputs are returned as they are (users may change them).
        arm = functools.partial(_arm_window, self.reducer, sync)
        for node in nodes:
            node.register_prehook(arm)
        return output

    def _unarmed_sync(self) -> bool | None:
        """The reducer's question for a backward no armed output reached: the last forward's decision until a
        backward took it (a parameter reached first through a loss term the forward did not return, outputs no
        traversal finds); after that, None: no forward of the wrapper leads to this backward (one through the bare
        module), and its gradients stay local, as in torch."""
        sync, armed = self._forward_sync
        return sync if armed == self.reducer.armed else None

    def _note_reachable(self, outputs: list[torch.Tensor]) -> None:
        """Walk the graph the forward built; parameters it cannot reach need not be waited for in backward."""
        if self._reached_pass != self.reducer.synced_passes:  # the first forward since the last synced backward
            self._reached = set()
            self._reached_pass = self.reducer.synced_passes
        seen: set = set()
        stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if isinstance(node, torch.autograd.function.BackwardCFunction):
                # A custom autograd Function may run autograd inside its backward (reentrant checkpointing
                # does) and reach parameters the graph does not show: assume every parameter is reachable.
                self._reached = set(range(len(self.reducer.params)))
                break
            variable = getattr(node, "variable", None)
            if variable is not None:
                index = self._param_index.get(id(variable))
                if index is not None:
                    self._reached.add(index)
            stack.extend(next_node for next_node, _ in node.next_functions)
        self.reducer.set_unreachable([i for i in range(len(self.reducer.params)) if i not in self._reached])

    # -- the torch surface ---------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forward and backward passes run inside accumulate gradients locally; the next synchronised backward
        reduces the sum. As with torch's wrapper, the forward decides: a backward of a forward run inside does
        not synchronise, whether or not it runs inside too."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Replace the bucket all-reduce by `hook(state, bucket) -> Future[Tensor]`, before the first backward."""
        checks.check_comm_hook(hook)
        if self.zero_stage == 2:
            raise RuntimeError("a comm hook replaces the bucket reduction, and zero_stage=2 needs its own "
                               "(a reduce-scatter into this rank's shard); use zero_stage=0 to register hooks")
        if self.reducer is None:  # a world of one never communicates; the hook is kept for introspection
            if getattr(self, "_comm_hook", None) is not None:
                raise RuntimeError(HOOK_ONCE)
            self._comm_hook = (state, hook)
            return
        self.reducer.register_comm_hook(state, hook)

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> contextlib.AbstractContextManager:
        """Around a training loop whose ranks hold different numbers of batches (torch's contract; see
        ddpkit.engine.join): a rank that ran out shadows the others' collectives until all have, then every rank takes
        the model of the last to join. Gradients are the sum over the ranks still training divided by the
        initial world size, or with divide_by_initial_world_size=False by the number of ranks still training.
        throw_on_early_termination=True: every rank raises RuntimeError once one has run out. enable=False:
        nothing changes. Inside, buffers come from the highest-numbered rank still training, as in torch."""
        if self.reducer is None:
            return contextlib.nullcontext()  # a world of one: nobody to wait for
        if self.zero_stage == 2:
            refuse_stage_2(enable)
            return contextlib.nullcontext()  # disabled: a Join would ask for the hook, which refuses stage 2
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """nn.Module's; under zero_stage=2 the gradients are this rank's shards, and they are cleared too (else
        the next backward would add to them). Clearing reads no value: gathers in flight go on."""
        with torch._C.DisableTorchFunctionSubclass():
            super().zero_grad(set_to_none)
        if self._grad_shards is not None:
            self._grad_shards.zero_grad(set_to_none)

    def check_replicas(self, what: str = "replica check") -> None:
        """Fail on every rank, naming the first diverging rank and parameter, if any replica differs from rank 0's.

        Costs one all-gather of two float64 numbers per parameter (a sum and a sum of squares, compared bit for
        bit); cheap enough to run every few hundred steps.
        """
        if self._grad_shards is not None:
            self._grad_shards.wait_all()
        if self.reducer is not None:
            checks.check_replicas(self.module, self._comm, what)

    @property
    def bucket_plan(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order (empty in a world of one or before the first backward)."""
        return self.reducer.bucket_plan() if self.reducer is not None else []


# DDPOptimizer gives its first graph piece this many bytes of parameters and asserts that the cap it reads from
# the active DDP module is no smaller, so torch's own wrapper cannot compile with bucket_cap_mb below 1 MiB.
# Below it ddpkit hands Dynamo this cap instead: a piece then holds several of ddpkit's buckets, which still
# launch between the pieces' backwards.
DYNAMO_FIRST_BUCKET_BYTES = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 1024 * 1024)


@dataclasses.dataclass(frozen=True)
class _SplitForDynamo:
    """What Dynamo reads from the active DDP module: the parameter bytes per graph piece."""

    bucket_bytes_cap: int


def _arm_window(reducer: Reducer, sync: bool, grad_outputs: Any) -> None:
    """Pre-hook of the forward's output nodes: open the reducer's BackwardPass for the backward that is starting."""
    reducer.arm(sync)


def _default_group() -> dist.ProcessGroup | None:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_group()


install_refusals(DistributedDataParallel)
