"""join() for uneven inputs: ddpkit's wrapper against torch's, running the same script in the same gloo world.

Truth is torch's DistributedDataParallel under its own join() (parameters and buffers to 1e-6), plus what the
contract says outright: on a step only some ranks train, the gradient is their sum divided by the initial world
size (or by their number), buffers come from the highest-numbered rank still training, the final model from the
last rank to join, and every rank ends with the same model. Ranks that ran out must issue the very collectives
(op and name, at each position) of those still training.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join as TorchJoin
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from helpers import models
from helpers.world import run_world

TOL = 1e-6
SHARD = 4  # samples per rank and batch
CAP = {"bucket_cap_mb": 0.002}  # several buckets even for these small models


def _batch(name: str, rank: int, step: int, seed: int):
    return models.batch(name, SHARD, 1000 * seed + 10 * step + rank)


def _optimizer_and_join(model, how: str, divide: bool, throw: bool, weight_decay: float):
    """_train's optimizer (SGD, plain or sharded) and what makes its join context (see _train's `how`)."""
    import ddpkit

    if how.startswith(("Join+", "ddpkit Join+")):  # Join([model, optimizer]) with torch's ZeRO or ddpkit's
        zero = ZeroRedundancyOptimizer if how == "Join+ZeRO" else ddpkit.ZeroRedundancyOptimizer
        optimizer = zero(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, weight_decay=weight_decay)
        join = ddpkit.Join if how.startswith("ddpkit") else TorchJoin
        return optimizer, lambda: join([model, optimizer], divide_by_initial_world_size=divide)
    if how == "ZeRO first":
        optimizer = ddpkit.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
        return optimizer, lambda: TorchJoin([optimizer, model], divide_by_initial_world_size=divide)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=weight_decay)
    # (one Join at a time: building one sets the wrapper's join config)
    return optimizer, {"join": lambda: model.join(divide, True, throw), "disabled": lambda: model.join(enable=False),
                       "plain": contextlib.nullcontext}[how]


def _train(world, impl: str, name: str, batches: list[int], how: str = "join", divide: bool = True,
           accumulate: int = 1, seed: int = 0, throw: bool = False, check_grads: bool = False,
           before_first: bool = False, as_view: bool = False, hook: bool = False, epochs: int = 1,
           keep_grads: bool = False, weight_decay: float = 0.0, reuse: bool = False) -> dict:
    """One training script: `how` is "join" (model.join()), "Join+ZeRO" or "Join+ddpkit ZeRO" (torch's
    Join([model, ZeRO]) with torch's or ddpkit's ZeroRedundancyOptimizer), "ddpkit Join+ddpkit ZeRO" (ddpkit's
    Join with ddpkit's ZeRO), "ZeRO first" (Join([ZeRO, model])),
    "disabled" (model.join(enable=False)) or "plain" (no join), around each of `epochs` epochs (reuse: one Join
    object entered at each). SGD with weight_decay; keep_grads: zero_grad(set_to_none=False). Returns the final
    state and what was seen."""
    import ddpkit
    import ddpkit.engine.comm_hooks

    torch.manual_seed(seed)
    net = models.make(name)
    model = (ddpkit.DistributedDataParallel if impl == "ddpkit" else TorchDDP)(net, gradient_as_bucket_view=as_view,
                                                                             **CAP)
    if hook:  # each its own library's all-reduce hook: a rank that ran out runs it on zeros
        model.register_comm_hook(None, ddpkit.engine.comm_hooks.allreduce_hook if impl == "ddpkit" else
                                 default_hooks.allreduce_hook)
    optimizer, context = _optimizer_and_join(model, how, divide, throw, weight_decay)
    out: dict = {"grad_errors": [], "seen_buffers": None, "error": None}
    first = ddpkit.Comm.for_group(None).seq  # this run's collectives are numbered after it
    if before_first:  # rank-specific running statistics: the first forward's broadcast shows their source
        for module in net.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.fill_(float(world.rank))
        seen: list[float] = []
        net.register_forward_pre_hook(lambda m, i: seen.append(float(net.bn1.running_mean[0])))
    if reuse:
        context = (lambda once: lambda: once)(context())
    try:
        for epoch in range(epochs):
            with context():
                for step in range(batches[world.rank]):
                    x, y = _batch(name, world.rank, step, seed + epoch)
                    sync = (step + 1) % accumulate == 0
                    with contextlib.nullcontext() if sync else model.no_sync():
                        models.loss(name, model, x, y, world.rank, step).backward()
                    if check_grads and sync:
                        out["grad_errors"].append(_grad_error(name, net, x, y, world, batches, step, divide))
                    if sync:
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=not keep_grads)
                out["own_state"] = _state(net)  # before the last to join hands its model to the others
    except RuntimeError as exc:
        out["error"] = str(exc)
    out["state"] = _state(net)
    if before_first:
        out["seen_buffers"] = seen[0]
    if impl == "ddpkit":
        log = ddpkit.Comm.for_group(None).log
        out["log"] = [(r.seq, r.op, r.what) for r in log if r.seq > first]  # (the log keeps the latest 64)
    return out


def _grad_error(name, net, x, y, world, batches, step, divide) -> float:
    """How far the reduced gradient is from the contract's, on a step only the ranks still holding data train
    (1 sample of each of their shards weighs 1 / world size, or 1 / their number)."""
    training = [r for r in range(world.world_size) if batches[r] > step]
    if len(training) != 1:
        return 0.0  # several ranks: checked against torch's wrapper instead
    alone = models.make(name)
    alone.load_state_dict(net.state_dict())
    models.loss(name, alone, x, y, world.rank, step).backward()
    divisor = world.world_size if divide else 1
    return max(float((p.grad - q.grad / divisor).abs().max()) for p, q in zip(net.parameters(), alone.parameters()))


def _state(net) -> dict[str, np.ndarray]:
    """Parameters and buffers as float64 arrays (exact for float32; tensors would travel by file descriptor)."""
    return {k: v.detach().double().numpy().copy() for k, v in net.state_dict().items()}


def _diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def _compare(world, name: str, batches: list[int], **kwargs) -> dict:
    """The same script under torch's wrapper and ddpkit's; their differences and ddpkit's run."""
    theirs = _train(world, "torch", name, batches, **kwargs)
    ours = _train(world, "ddpkit", name, batches, **kwargs)
    return {"vs_torch": _diff(ours["state"], theirs["state"]), "ours": ours, "theirs": theirs}


def _refused_order() -> str:
    """ddpkit's Join refuses the optimizer before the model (its hook would step before the model's shadowed)."""
    import ddpkit

    model = ddpkit.DistributedDataParallel(models.make("mlp"))
    zero = ddpkit.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    try:
        ddpkit.Join([zero, model])
    except ValueError as exc:
        zero.step()  # usable outside any Join after the refusal
        return str(exc)
    return "accepted"


def two_ranks(world) -> dict:
    out = {}
    out["mlp"] = _compare(world, "mlp", [3, 5], check_grads=True)
    out["mlp_mean"] = _compare(world, "mlp", [3, 5], divide=False, check_grads=True)
    out["learning"] = _compare(world, "mlp", [0, 3])  # rank 0 ran out before the first backward set the buckets
    out["hook_view"] = _compare(world, "mlp", [4, 2], hook=True, as_view=True)
    # rank 0 trains longest: it is the last to join, not the highest rank
    out["bn_accumulate"] = _compare(world, "convbn", [6, 3], accumulate=2)
    out["bn_source"] = _compare(world, "convbn", [2, 2], before_first=True)
    even = {how: _train(world, "ddpkit", "mlp", [3, 3], how=how) for how in ("plain", "join", "disabled")}
    out["even"] = {how: run["state"] for how, run in even.items()}
    out["disabled_log"] = [what for _, _, what in even["disabled"]["log"]]
    out["bn_even"] = {how: _train(world, "ddpkit", "convbn", [2, 2], how=how)["state"] for how in ("plain", "join")}
    # two epochs: what a rank that ran out holds in .grad when the join ends must not reach the next epoch
    out["two_epochs"] = _compare(world, "mlp", [3, 1], epochs=2)
    out["zero_first"] = _train(world, "ddpkit", "mlp", [2, 3], how="ZeRO first")["error"]
    out["zero_before_model"] = _refused_order()
    out["throw"] = _compare(world, "mlp", [2, 3], throw=True)  # last: it leaves the wrappers mid-iteration
    return out


def three_ranks(world) -> dict:
    out = {}
    out["bn"] = _compare(world, "convbn", [2, 4, 3])  # rank 1 is the last to join
    out["bn_tie"] = _compare(world, "convbn", [3, 1, 3])  # ranks 0 and 2 tie: rank 2's model
    out["bn_mean_accumulate"] = _compare(world, "convbn", [5, 2, 4], divide=False, accumulate=2)
    # ZeRO joined beside the model: a rank that ran out steps its shard for the others, with the .grad ddpkit's
    # wrapper leaves it (their average), so the result is that of join() with the unsharded optimizer, bit for
    # bit. (torch's wrapper leaves the joined rank its stale .grad, so torch's DDP + ZeRO is not compared.)
    out["zero"] = {how: _train(world, "ddpkit", "mlp", [2, 4, 3], how=how)
                   for how in ("join", "Join+ZeRO", "Join+ddpkit ZeRO")}
    # rank 1 runs out first; the branch only rank 0 takes is used at the next step, unused once rank 0 ran out
    out["zero_branchy"] = {how: _train(world, "ddpkit", "branchy", [2, 1, 4], how=how)
                           for how in ("join", "Join+ZeRO", "Join+ddpkit ZeRO")}
    # zero_grad(set_to_none=False): the branch no rank uses any more gets zeros, so weight decay still acts
    out["zero_branchy_keep"] = {how: _train(world, "ddpkit", "branchy", [2, 1, 4], how=how, keep_grads=True,
                                            weight_decay=0.1) for how in ("join", "Join+ZeRO", "Join+ddpkit ZeRO")}
    # one ddpkit Join entered at each of two epochs
    out["zero_reuse"] = {how: _train(world, "ddpkit", "mlp", [1, 3, 2], how=how, epochs=2, reuse=True)
                         for how in ("join", "ddpkit Join+ddpkit ZeRO")}
    # accumulation: the others step every second batch; under ddpkit's Join the optimizer's hook steps with them
    out["zero_accumulate"] = {how: _train(world, "ddpkit", "mlp", [2, 6, 4], how=how, accumulate=2)
                              for how in ("join", "ddpkit Join+ddpkit ZeRO")}
    out["bn_source"] = _compare(world, "convbn", [1, 3, 2], before_first=True)
    out["throw"] = _compare(world, "mlp", [2, 1, 3], throw=True)
    return out


def _check_run(results: list[dict], key: str, last_to_join: int) -> None:
    """ddpkit's run equals torch's on every rank, the replicas are identical and the last to join's model,
    and every rank issued the same collectives in the same order."""
    runs = [r[key] for r in results]
    for rank, run in enumerate(runs):
        assert run["vs_torch"] <= TOL, (key, rank, run["vs_torch"])
        assert run["ours"]["error"] is None and run["theirs"]["error"] is None, key
        assert max(run["ours"]["grad_errors"] + [0.0]) <= TOL, (key, rank, run["ours"]["grad_errors"])
        assert max(run["theirs"]["grad_errors"] + [0.0]) <= TOL, (key, rank)  # the contract is torch's
        assert _diff(run["ours"]["state"], runs[0]["ours"]["state"]) == 0.0, (key, rank)
        assert run["ours"]["log"] == runs[0]["ours"]["log"], (key, rank)
    assert _diff(runs[0]["ours"]["state"], runs[last_to_join]["ours"]["own_state"]) == 0.0, key
    assert any("join: ranks still training" in what for _, _, what in runs[0]["ours"]["log"]), key


def _check_throw(results: list[dict]) -> None:
    for rank, result in enumerate(results):
        ours, theirs = result["throw"]["ours"]["error"], result["throw"]["theirs"]["error"]
        assert ours is not None and theirs is not None, rank  # every rank raises, RuntimeError, as torch's
        assert "exhausted" in ours and "exhausted" in theirs, (ours, theirs)
        assert result["throw"]["ours"]["log"] == results[0]["throw"]["ours"]["log"]


def test_join_on_two_ranks():
    results = run_world(two_ranks, 2, deadline_s=240)
    for key, last in (("mlp", 1), ("mlp_mean", 1), ("learning", 1), ("hook_view", 0), ("bn_accumulate", 0),
                      ("bn_source", 1), ("two_epochs", 0)):
        _check_run(results, key, last)
    # the steps rank 1 trained alone were checked against the contract (sum / 2, then / 1): not both ways
    assert all(len(r["mlp"]["ours"]["grad_errors"]) == (3 if i == 0 else 5) for i, r in enumerate(results))
    assert _diff(results[1]["mlp"]["ours"]["state"], results[1]["mlp_mean"]["ours"]["state"]) > 1e-4
    # buffers from the highest rank still training, from the first forward on (rank 1's running_mean of 1.0)
    for result in results:
        assert result["bn_source"]["ours"]["seen_buffers"] == 1.0
        assert result["bn_source"]["theirs"]["seen_buffers"] == 1.0
    # even inputs: join() changes no parameter (bit for bit), enable=False issues no join collective
    for result in results:
        plain = result["even"]["plain"]
        assert _diff(plain, result["even"]["join"]) == 0.0 and _diff(plain, result["even"]["disabled"]) == 0.0
        assert result["disabled_log"] and not any(what.startswith("join:") for what in result["disabled_log"])
        bn = result["bn_even"]
        params = [k for k in bn["plain"] if "running" not in k and "num_batches" not in k]
        assert max(float(np.abs(bn["plain"][k] - bn["join"][k]).max()) for k in params) == 0.0
    # ... but BatchNorm statistics differ: under join() they come from rank 1, as in torch, not from rank 0
    assert _diff(results[0]["bn_even"]["plain"], results[0]["bn_even"]["join"]) > 0
    _check_throw(results)
    for result in results:  # every rank trains at the first step, so every rank raises there: nothing hangs
        assert "cannot be the first joinable" in result["zero_first"], result["zero_first"]
        assert "put the model before" in result["zero_before_model"], result["zero_before_model"]


def test_join_on_three_ranks():
    results = run_world(three_ranks, 3, deadline_s=300)
    for key, last in (("bn", 1), ("bn_tie", 2), ("bn_mean_accumulate", 0), ("bn_source", 1)):
        _check_run(results, key, last)
    for rank, result in enumerate(results):
        for key in ("zero", "zero_branchy", "zero_branchy_keep", "zero_reuse", "zero_accumulate"):
            runs = result[key]
            for how in set(runs) - {"join"}:
                assert runs[how]["error"] is None, (key, how, rank, runs[how]["error"])
                assert _diff(runs[how]["state"], runs["join"]["state"]) == 0.0, (key, how, rank)
                assert runs[how]["log"] == results[0][key][how]["log"], (key, how, rank)  # the same collectives
    for result in results:
        assert result["bn_source"]["ours"]["seen_buffers"] == 2.0
        assert result["bn_source"]["theirs"]["seen_buffers"] == 2.0
    _check_throw(results)
