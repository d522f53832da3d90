"""The constructor's checks: the same misuse gets the same exception type from ddpkit's wrapper as from torch's.

One table, one row per misuse: (name, how to commit it with a given wrapper class, a pattern ddpkit's message
must match). Both wrappers commit every misuse in one spawned world of one gloo rank (torch's wrapper needs a
process group); a second table holds the misuses torch accepts silently and ddpkit refuses on purpose.
A model that differs across ranks is a RuntimeError in both (the last test checks ddpkit's on every rank;
torch's raises on one rank and leaves the other waiting in its parameter broadcast, so it is not run here).
"""

from __future__ import annotations

import inspect
import pickle
import re
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel.distributed import _MixedPrecision

from helpers import models
from helpers.world import run_world


class MetaHalf(torch.nn.Module):
    """Parameters on two kinds of device (CPU and meta)."""

    def __init__(self):
        super().__init__()
        self.cpu = torch.nn.Linear(2, 2)
        self.meta = torch.nn.Linear(2, 2, device="meta")


def _lin():
    return torch.nn.Linear(3, 3)


def _annotated(bucket: object = None, returns: object = None):
    """A comm hook annotated with these objects (not strings, whatever this module's __future__ import)."""
    def hook(state, bucket):
        raise AssertionError("never called")

    hook.__annotations__ = {k: v for k, v in (("bucket", bucket), ("return", returns)) if v is not None}
    return hook


def _twice(cls):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = cls(_lin())
    for _ in range(2):
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)


SAME_TYPE = [
    ("no parameter requires a gradient", lambda cls: cls(_lin().requires_grad_(False)), r"requires a gradient"),
    ("no parameters at all", lambda cls: cls(torch.nn.ReLU()), r"requires a gradient"),
    ("device_ids for a CPU module", lambda cls: cls(_lin(), device_ids=[0]), r"leave device_ids=None"),
    ("two device_ids", lambda cls: cls(_lin(), device_ids=[0, 1]), r"exactly one device"),
    ("output_device without device_ids", lambda cls: cls(_lin(), output_device=1), r"output_device"),
    ("parameters on two kinds of device", lambda cls: cls(MetaHalf()), r"several kinds of device.*meta"),
    ("a lazy module not yet run", lambda cls: cls(torch.nn.LazyLinear(3)), r"not initialised.*forward pass"),
    ("an argument neither wrapper has", lambda cls: cls(_lin(), bogus=1), r"bogus"),
    ("delay_all_reduce_named_params alone", lambda cls: cls(_lin(), delay_all_reduce_named_params=[]),
     r"go together"),
    ("process_group and device_mesh", lambda cls: cls(_lin(), process_group=dist.group.WORLD, device_mesh=object()),
     r"Cannot specify both process_group and device_mesh arguments"),
    ("a bucket of NaN MiB", lambda cls: cls(_lin(), bucket_cap_mb=float("nan")), r"bucket_cap_mb"),
    ("a comm hook that is not callable", lambda cls: cls(_lin()).register_comm_hook(None, "allreduce"),
     r"Communication hook must be callable"),
    ("a comm hook registered twice", lambda cls: _twice(cls), r"can only be called once"),
    ("a comm hook whose bucket is annotated a tensor",
     lambda cls: cls(_lin()).register_comm_hook(None, _annotated(bucket=torch.Tensor)),
     r"bucket annotation should be dist.GradBucket"),
    ("a comm hook annotated to return a tensor",
     lambda cls: cls(_lin()).register_comm_hook(None, _annotated(returns=torch.Tensor)),
     r"return annotation should be torch.futures.Future\[torch.Tensor\]"),
    ("pickling over a group other than the default",
     lambda cls: pickle.dumps(cls(_lin(), process_group=dist.new_group([0]))), r"default process group"),
    ("a logging sample rate below 1", lambda cls: cls(_lin())._set_ddp_runtime_logging_sample_rate(0),
     r"at least 1"),
]

# torch accepts these without a word; each is a mistake (or something ddpkit cannot do) that ddpkit names.
DDPKIT_ONLY = [
    ("a bucket of zero MiB", lambda cls: cls(_lin(), bucket_cap_mb=0), ValueError, r"bucket_cap_mb must be a positive"),
    # torch tests `device_ids or output_device`, so it ignores output_device=0 but refuses output_device=1.
    ("output_device=0 without device_ids", lambda cls: cls(_lin(), output_device=0), ValueError, r"output_device"),
    ("sparse gradients", lambda cls: cls(torch.nn.Embedding(4, 2, sparse=True)), NotImplementedError,
     r"sparse=False"),
    ("DDP-native mixed precision",
     lambda cls: cls(_lin(), mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16)), NotImplementedError,
     r"mixed_precision.*torch.autocast"),
    ("per-bucket caps", lambda cls: cls(_lin(), bucket_cap_mb_list=[1, 2]), NotImplementedError,
     r"bucket_cap_mb_list"),
]


def _outcome(misuse, cls) -> tuple[str, str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            misuse(cls)
        except Exception as exc:  # noqa: BLE001 - the type is what is compared
            return type(exc).__name__, str(exc)
    return "no error", ""


def both_wrappers(world):
    import ddpkit

    torch_ddp = torch.nn.parallel.DistributedDataParallel
    rows = {}
    for name, misuse, *_ in SAME_TYPE + DDPKIT_ONLY:
        rows[name] = {"torch": _outcome(misuse, torch_ddp), "ddpkit": _outcome(misuse, ddpkit.DistributedDataParallel)}
    return rows


@pytest.fixture(scope="module")
def outcomes():
    return run_world(both_wrappers, 1)[0]


@pytest.mark.parametrize("name, misuse, pattern", SAME_TYPE, ids=[row[0] for row in SAME_TYPE])
def test_same_exception_type_as_torch(outcomes, name, misuse, pattern):
    theirs, ours = outcomes[name]["torch"], outcomes[name]["ddpkit"]
    assert theirs[0] != "no error", f"{name}: torch's wrapper accepted it (the row belongs in DDPKIT_ONLY)"
    assert ours[0] == theirs[0], f"{name}: ddpkit raised {ours}, torch raised {theirs}"
    assert re.search(pattern, ours[1]), f"{name}: ddpkit's message {ours[1]!r}"


@pytest.mark.parametrize("name, misuse, error, pattern", DDPKIT_ONLY, ids=[row[0] for row in DDPKIT_ONLY])
def test_refused_where_torch_is_silent(outcomes, name, misuse, error, pattern):
    theirs, ours = outcomes[name]["torch"], outcomes[name]["ddpkit"]
    assert theirs[0] == "no error", f"{name}: torch now raises {theirs}; align the type and move the row"
    assert ours[0] == error.__name__ and re.search(pattern, ours[1]), ours


def test_signature_is_torchs():
    """Same parameter names, order and defaults: positional and keyword calls written for torch's work."""
    import ddpkit

    theirs = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    ours = dict(inspect.signature(ddpkit.DistributedDataParallel.__init__).parameters)
    # ddpkit's own additions come after every one of torch's, keyword-only, so no call written for torch moves.
    added = {name: ours.pop(name) for name in ("zero_stage",)}
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in added.values())
    assert list(ours) == list(theirs)
    assert [p.default for p in ours.values()] == [p.default for p in theirs.values()]


# -- forward_sync_buffers and broadcast_buffers: torch 2.13's precedence (pure) ---------------------------------
@pytest.mark.parametrize("broadcast, forward, want", [
    (None, None, (True, True)),      # the defaults: buffers broadcast at construction and at each forward
    (False, None, (False, False)),   # the deprecated flag also keeps buffers out of the construction broadcast
    (True, None, (True, True)),
    (None, False, (False, True)),    # the new flag leaves the construction broadcast alone
    (None, True, (True, True)),
    (False, True, (True, True)),     # both: forward_sync_buffers wins (a FutureWarning whenever the old one is given)
    (True, False, (False, True)),
])
def test_buffer_sync_precedence(broadcast, forward, want):
    from ddpkit.engine import checks as ddp_checks

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ddp_checks.buffer_sync(broadcast, forward) == want
    assert [w.category for w in caught] == ([FutureWarning] if broadcast is not None else [])  # torch 2.13's


def test_forward_sync_buffers_attribute_and_property():
    import ddpkit

    ddp = ddpkit.DistributedDataParallel(models.ConvBN(), forward_sync_buffers=False)
    assert ddp.forward_sync_buffers is False and ddp.broadcast_buffers is False
    ddp.broadcast_buffers = True  # torch's property has a setter that sets forward_sync_buffers
    assert ddp.forward_sync_buffers is True and len(ddp._buffers_to_sync) == len(list(ddp.module.buffers()))
    ddp.forward_sync_buffers = False
    assert ddp._buffers_to_sync == []


# -- construction errors (no processes needed) --------------------------------------------------------------------
def test_meaningless_arguments_fail_clearly():
    import ddpkit

    with pytest.raises(ValueError, match="bucket_cap_mb"):
        ddpkit.DistributedDataParallel(models.MLP(), bucket_cap_mb=0)
    with pytest.raises(ValueError, match="device_ids"):
        ddpkit.DistributedDataParallel(models.MLP(), device_ids=[0])
    with pytest.raises(ValueError, match="output_device"):
        ddpkit.DistributedDataParallel(models.MLP(), output_device=0)
    frozen = models.MLP().requires_grad_(False)
    with pytest.raises(RuntimeError, match="requires a gradient"):  # torch's type for the same misuse
        ddpkit.DistributedDataParallel(frozen)
    with pytest.raises(NotImplementedError, match="mixed_precision"):  # torch's argument, not ddpkit's
        ddpkit.DistributedDataParallel(models.MLP(), mixed_precision=object())
    with pytest.raises(TypeError, match="bogus"):  # an argument neither wrapper has: Python's TypeError
        ddpkit.DistributedDataParallel(models.MLP(), bogus=1)


def test_world_of_one_is_a_thin_wrapper():
    """No process group at all: the wrapper still works and its state_dict has torch's keys."""
    import ddpkit

    model = models.MLP()
    ddp = ddpkit.DistributedDataParallel(model)
    torch_keys = ["module." + k for k in model.state_dict()]
    assert list(ddp.state_dict()) == torch_keys
    x, y = models.batch("mlp", 4, 0)
    with ddp.no_sync():
        models.loss("mlp", ddp, x, y, 0, 0).backward()
    assert ddp.module is model and model.net[0].weight.grad is not None
    assert ddp.reducer is None
    # Code that unwraps torch's wrapper by type (accelerate, the Transformers Trainer) unwraps ours too.
    assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel)
    assert ddp.broadcast_buffers is True and ddp.bucket_bytes_cap == 25 * 1024 * 1024
    ddp.train(False)
    assert not model.training


def mismatched_model(world):
    import ddpkit

    hidden = 32 if world.rank != 1 else 31
    ddpkit.DistributedDataParallel(models.MLP(hidden=hidden))
    return "constructed"


def test_model_mismatch_fails_on_every_rank():
    outcomes = run_world(mismatched_model, 3, expect_errors=True, deadline_s=60)
    for status, text in outcomes:
        assert status == "error", "a rank built a DDP over a mismatched model"
        assert "rank 1" in text and "net.0.weight" in text and "[31, 12]" in text, text


def test_inputs_move_as_torchs_and_cuda_without_an_index_is_the_current_device(monkeypatch):
    """No GPU here: the meta device stands in for the input move, torch.cuda.current_device for the index."""
    from ddpkit.engine.checks import _cuda_index
    from ddpkit.engine.forward_io import move_to

    packed = torch.nn.utils.rnn.pack_sequence([torch.ones(3, 2), torch.ones(1, 2)])
    moved = move_to({"x": packed, "n": 2, "t": torch.ones(2)}, torch.device("meta"))
    assert moved["x"].data.is_meta and moved["x"].batch_sizes.device.type == "cpu"  # torch's rule for it
    assert moved["t"].is_meta and moved["n"] == 2
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert [_cuda_index(d) for d in ("cuda", torch.device("cuda"), "cuda:1", 2)] == [3, 3, 1, 2]
