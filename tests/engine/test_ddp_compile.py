"""torch.compile with ddpkit's wrapper: buckets launch while a compiled backward is still running.

A compiled module's backward is one autograd node unless Dynamo's DDPOptimizer splits the graph at bucket
boundaries, which it does while the wrapper's forward names itself the active DDP module. Overlap is counted
the way tests/engine/test_ddp.py counts it (reducer.launched_during_backward), read at the moment the *last* compiled
backward piece starts: buckets launched by then were launched while backward still had compiled work to do.
With torch._dynamo.config.optimize_ddp off (the control) that count is 0. Gradients are checked against one
process on the concatenated batch, to 1e-6. The backend is aot_eager: the split happens before the backend
compiles anything, so it is the same with inductor, and aot_eager compiles in a fraction of the time.
"""

from __future__ import annotations

import copy

import torch
from torch.utils.checkpoint import checkpoint

from helpers.world import run_world

TOL = 1e-6
WIDTH = 512  # one 512x512 float32 weight is 1 MiB: with bucket_cap_mb=1 each layer is about a bucket


class Deep(torch.nn.Module):
    def __init__(self, layers: int = 4, checkpointed: str = ""):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers))
        self.head = torch.nn.Linear(WIDTH, 4)
        self.checkpointed = checkpointed  # "", "each layer" or "all layers"

    def _body(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x

    def forward(self, x):
        if self.checkpointed == "all layers":
            return self.head(checkpoint(self._body, x, use_reentrant=False))
        for layer in self.layers:
            if self.checkpointed == "each layer":
                x = checkpoint(lambda t, layer=layer: torch.tanh(layer(t)), x, use_reentrant=False)
            else:
                x = torch.tanh(layer(x))
        return self.head(x)


def _compiled_nodes(tensor: torch.Tensor) -> list:
    seen, stack, found = set(), [tensor.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "CompiledFunction" in type(node).__name__:
            found.append(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def _placed(model, placement: str, **ddp_kwargs):
    """(the wrapper, what to call): "DDP(compile(model))" or "compile(DDP(model))", compiled with aot_eager."""
    import ddpkit

    if placement == "DDP(compile(model))":
        ddp = ddpkit.DistributedDataParallel(torch.compile(model, backend="aot_eager"), **ddp_kwargs)
        return ddp, ddp
    ddp = ddpkit.DistributedDataParallel(model, **ddp_kwargs)
    return ddp, torch.compile(ddp, backend="aot_eager")


def train_compiled(world, placement: str, cap: float, optimize_ddp: bool = True, checkpointed: str = ""):
    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = optimize_ddp
    r, n = world.rank, world.world_size
    torch.manual_seed(0)
    model = Deep(checkpointed=checkpointed)
    ref = copy.deepcopy(model)
    ddp, run = _placed(model, placement, bucket_cap_mb=cap)
    steps = []
    for step in range(3):
        x = torch.randn(4 * n, WIDTH, generator=torch.Generator().manual_seed(step))
        for p in [*model.parameters(), *ref.parameters()]:
            p.grad = None
        loss = run(x[4 * r:4 * r + 4]).square().mean()
        pieces, started = _compiled_nodes(loss), []
        for node in pieces:
            node.register_prehook(lambda grads: started.append(ddp.reducer.launched_during_backward))
        loss.backward()
        (sum(ref(x[4 * k:4 * k + 4]).square().mean() for k in range(n)) / n).backward()
        error = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
        steps.append({"error": error, "pieces": len(pieces), "before_last_piece": started[-1],
                      "buckets": len(ddp.reducer.buckets)})
    torch._dynamo.config.optimize_ddp = True
    return {"steps": steps, "active_after": torch.nn.parallel.DistributedDataParallel._get_active_ddp_module(),
            "params": [p.detach().sum().item() for p in model.parameters()]}


def stage2_compiled(world, placement: str) -> dict:
    """zero_stage=2 under torch.compile: whether every step's forward ran compiled (a held parameter's class would
    fail Dynamo's guards: a recompile, or the frame run uncompiled), and its losses against zero_stage=0."""
    import ddpkit

    out = {}
    for stage in (0, 2):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Deep(layers=2)
        ddp, run = _placed(model, placement, bucket_cap_mb=1.0, zero_stage=stage)
        opt = ddpkit.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, lr=0.1) if stage else \
            torch.optim.SGD(ddp.parameters(), lr=0.1)
        compiled, losses = [], []
        for step in range(4):
            x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(10 * step + world.rank))
            opt.zero_grad()
            loss = run(x).square().mean()
            compiled.append(bool(_compiled_nodes(loss)))
            losses.append(loss.item())
            loss.backward()
            opt.step()
        out[stage] = (compiled, losses)
    return out


def dynamo_work(world) -> list[tuple[int, int]]:
    """compile(DDP(model, find_unused_parameters=True)): Dynamo's graphs and graph breaks so far, after each step.
    The wrapper's own frames run eagerly (its walk of the autograd graph, the window it arms), so that Dynamo
    compiles the module's forward once; traced, they broke the graph and were traced again at every step."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    ddp, run = _placed(Deep(layers=2), "compile(DDP(model))", bucket_cap_mb=1.0, find_unused_parameters=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    seen = []
    for step in range(4):
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(10 * step + world.rank))
        run(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        seen.append((counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())))
    return seen


def compiled_cases(world):
    cases = {"dynamo work": dynamo_work(world)}
    cases.update({"stage 2 " + placement: stage2_compiled(world, placement)
             for placement in ("DDP(compile(model))", "compile(DDP(model))")})
    for placement in ("DDP(compile(model))", "compile(DDP(model))"):
        cases[placement] = train_compiled(world, placement, cap=1.0)
        # Below DDPOptimizer's 1 MiB first piece torch's own wrapper cannot compile; ddpkit hands Dynamo 1 MiB.
        cases[placement + " tiny buckets"] = train_compiled(world, placement, cap=0.002)
    cases["control: optimize_ddp off"] = train_compiled(world, "DDP(compile(model))", cap=1.0, optimize_ddp=False)
    cases["checkpoint per layer"] = train_compiled(world, "compile(DDP(model))", cap=1.0, checkpointed="each layer")
    cases["checkpoint around all layers"] = train_compiled(world, "compile(DDP(model))", cap=1.0,
                                                           checkpointed="all layers")
    return cases


def test_buckets_launch_during_a_compiled_backward():
    a, b = run_world(compiled_cases, 2, deadline_s=400)
    for rank, seen in enumerate((a.pop("dynamo work"), b.pop("dynamo work"))):
        assert seen[0][0] == 1 and seen == seen[:1] * 4, f"rank {rank}: (graphs, graph breaks) after each step {seen}"
    for name in ("stage 2 DDP(compile(model))", "stage 2 compile(DDP(model))"):
        for rank, case in enumerate((a.pop(name), b.pop(name))):
            (compiled0, losses0), (compiled2, losses2) = case[0], case[2]
            assert compiled0 == compiled2 == [True] * 4, f"{name}, rank {rank}: a forward ran uncompiled: {case}"
            assert max(abs(x - y) for x, y in zip(losses0, losses2)) <= TOL, (name, rank, losses0, losses2)
    for name, case in a.items():
        assert case["params"] == b[name]["params"], f"{name}: replicas differ"
        for step, got in enumerate(case["steps"] + b[name]["steps"]):
            assert got["error"] <= TOL, f"{name} step {step}: off single-process truth by {got['error']:.3g}"
    for name in ("DDP(compile(model))", "compile(DDP(model))", "DDP(compile(model)) tiny buckets",
                 "compile(DDP(model)) tiny buckets", "checkpoint per layer"):
        case = a[name]
        assert case["active_after"] is None
        for got in case["steps"][1:]:  # the first backward only learns the bucket order
            assert got["pieces"] > 1, f"{name}: the compiled graph was not split ({got})"
            assert 1 < got["before_last_piece"] < got["buckets"], f"{name}: too few buckets overlapped ({got})"
    # The control: without the split, every bucket waits for the one compiled backward node to finish.
    assert all(got["pieces"] == 1 and got["before_last_piece"] == 0 for got in a["control: optimize_ddp off"]["steps"])
