"""ddpkit.trainer.parallelize: what the Trainer trains (the DDP wrapper, compiled under torch_compile) and what it saves (the plain
module, never torch.compile's `_orig_mod.` names). torch.compile is slow on 2 cores: one spawned world checks all
of the compiled Trainer at once, with aot_eager (Dynamo and AOT autograd, no code generation) and one short
inductor run."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ddpkit.distributed.env import single_process_env
from ddpkit.engine.ddp import DistributedDataParallel
from ddpkit.errors import ArgumentError
from ddpkit.trainer.optimizer_step import accumulate
from ddpkit.trainer.parallelize import ddp_of, prepare_model
from ddpkit.trainer.step_batches import StepBatches
from helpers.models import Classifier, classification_data, params_of, trainer_args
from helpers.world import run_world

# float64. Observed here: aot_eager bitwise (it runs eager's operations), inductor's parameters within 1.1e-16 and
# its losses bitwise (its fused kernels may sum in another order).
TOL = {"aot_eager": 1e-12, "aot_eager zero 2": 1e-12, "inductor": 1e-10}


def test_in_a_world_of_one_the_compiled_module_trains_and_the_plain_one_is_kept(tmp_path):
    world = single_process_env()
    model = Classifier()
    model.net[2].p = 0.0  # no dropout: the two ways must see the same network
    args = trainer_args(tmp_path, torch_compile=True, torch_compile_backend="eager")
    plain, wrapped = prepare_model(model, args, world)
    assert plain is model and wrapped is not model and wrapped._orig_mod is model
    assert ddp_of(wrapped) is None and ddp_of(model) is None
    # Accumulation on the compiled module of a world of one: no no_sync to ask for, the gradients of both add up.
    x = torch.randn(4, 6)
    share = accumulate(wrapped, StepBatches([x[:2], x[2:]], 4.0, 4, 2), None,
                       lambda m, batch, weight: m(batch)["logits"].sum().backward() or torch.zeros(()), world.device)
    compiled_grad = model.net[0].weight.grad.clone()
    model.zero_grad()
    model(x)["logits"].sum().backward()
    torch.testing.assert_close(compiled_grad, model.net[0].weight.grad)
    assert share.item() == 0.0
    # A model the caller compiled: trained compiled, saved and evaluated plain; compiling it twice is refused.
    compiled = torch.compile(Classifier(), backend="eager")
    plain, wrapped = prepare_model(compiled, trainer_args(tmp_path), world)
    assert plain is compiled._orig_mod and wrapped is compiled
    assert not any(name.startswith("_orig_mod") for name in plain.state_dict())
    with pytest.raises(ArgumentError, match="torch_compile: the model is compiled already"):
        prepare_model(compiled, trainer_args(tmp_path, torch_compile=True), world)


def _train(out, **kw):
    from ddpkit.trainer.trainer import Trainer

    torch.manual_seed(0)
    model = Classifier().double()
    model.net[2].p = 0.0  # compiled and eager dropout need not draw the same masks
    # 24 samples, 2 ranks x batch 3 x accumulation 2 (the first micro-batch under no_sync, which reaches the
    # wrapper inside the compiled module): every batch is full, so Dynamo compiles one shape.
    args = trainer_args(out, per_device_train_batch_size=3, gradient_accumulation_steps=2, max_steps=4,
                 save_strategy="steps", save_steps=4, ddp_replica_check_steps=2, **kw)
    trainer = Trainer(model, args, train_dataset=classification_data(24), eval_dataset=classification_data(6, seed=1))
    trainer.train()
    trainer.save_model()
    ddp = ddp_of(trainer.model_wrapped)
    return {"losses": [e["loss"] for e in trainer.state.log_history if "loss" in e], "params": params_of(model),
            "eval": trainer.evaluate()["eval_loss"], "plain": trainer.model is model,
            "ddp": isinstance(ddp, DistributedDataParallel), "compiled": trainer.model_wrapped is not ddp,
            "saved": {k: v.numpy() for k, v in load_file(f"{out}/model.safetensors").items()},
            "checkpoint": sorted(load_file(f"{out}/checkpoint-4/model.safetensors"))}


def compile_world(world, out):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    runs = {"eager": _train(f"{out}/eager")}
    runs["aot_eager"] = _train(f"{out}/aot_eager", torch_compile=True, torch_compile_backend="aot_eager")
    graphs = counters["stats"]["unique_graphs"]
    # ZeRO stage 2 compiled: its forward first waits for the last step's parameter all-gathers.
    runs["aot_eager zero 2"] = _train(f"{out}/zero2", torch_compile=True, torch_compile_backend="aot_eager",
                                      ddp_zero_stage=2)
    runs["inductor"] = _train(f"{out}/inductor", torch_compile=True)
    return runs, graphs, os.path.isdir(os.path.join(out, "eager"))


def test_a_compiled_trainer_on_two_ranks_matches_the_eager_one_and_saves_plain_weights(tmp_path):
    a, b = run_world(compile_world, 2, args=(str(tmp_path),), deadline_s=420)
    (runs, graphs, _), (runs_b, _, _) = a, b
    eager = runs["eager"]
    assert graphs > 0  # Dynamo did compile (this model fits one bucket: one graph)
    names = sorted(k for k, _ in Classifier().named_parameters())
    for backend, tol in TOL.items():
        run = runs[backend]
        assert run["plain"] and run["ddp"] and run["compiled"], backend
        np.testing.assert_allclose(run["losses"], eager["losses"], rtol=tol, atol=0, err_msg=backend)
        assert len(run["losses"]) == 4
        for x, y, t in zip(run["params"], runs_b[backend]["params"], eager["params"]):
            np.testing.assert_array_equal(x, y, err_msg=f"{backend}: replicas diverged")
            np.testing.assert_allclose(x, t, rtol=tol, atol=tol, err_msg=backend)
        assert run["eval"] == pytest.approx(eager["eval"], rel=tol)
        # The saved weights are the plain model's names and load into a plain model, strictly.
        assert sorted(run["saved"]) == names and run["checkpoint"] == names
        fresh = Classifier().double()
        fresh.load_state_dict({k: torch.from_numpy(v) for k, v in run["saved"].items()}, strict=True)
        for x, t in zip(params_of(fresh), run["params"]):
            np.testing.assert_array_equal(x, t)
    assert not eager["compiled"]


def buffers_at_wrapping(world):
    """Rank-local BatchNorm statistics after the Trainer's wrap, per ddp_broadcast_buffers, and its warnings."""
    import types
    import warnings

    from torch import nn

    from ddpkit.args.training_args import TrainingArguments
    from ddpkit.trainer.parallelize import apply_ddp

    out = {}
    for label, kw in (("default", {}), ("gradient checkpointing", {"gradient_checkpointing": True}),
                      ("False", {"ddp_broadcast_buffers": False})):
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        with torch.no_grad():
            model[1].running_mean.fill_(float(world.rank))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            apply_ddp(model, TrainingArguments(output_dir="unused", **kw), types.SimpleNamespace(device=world.device))
        out[label] = (model[1].running_mean[0].item(), [str(w.message) for w in caught if "buffers" in str(w.message)])
    return out


def test_ddp_broadcast_buffers_false_keeps_rank_local_buffers_at_wrapping_as_transformers_does():
    """Transformers' Trainer passes ddp_broadcast_buffers to torch's wrapper as broadcast_buffers: False (also the
    default under gradient checkpointing) keeps each rank's buffers at construction. Passed as
    forward_sync_buffers (to avoid torch 2.13's deprecation warning) rank 0's overwrote them."""
    zero, one = run_world(buffers_at_wrapping, 2, deadline_s=90)
    assert zero == {"default": (0.0, []), "gradient checkpointing": (0.0, []), "False": (0.0, [])}
    assert one == {"default": (0.0, []), "gradient checkpointing": (1.0, []), "False": (1.0, [])}


def test_gradient_checkpointing_kwargs_reach_the_model_and_train_alike(tmp_path, local_world):
    """Transformers' gradient_checkpointing_kwargs ('{"use_reentrant": false}' on the command line) go to
    model.gradient_checkpointing_enable, as Transformers passes them; recomputing trains the same weights."""
    import transformers

    from ddpkit.args.parser import ArgumentParser
    from ddpkit.trainer.trainer import Trainer

    def gpt2():
        config = transformers.GPT2Config(vocab_size=50, n_positions=32, n_embd=16, n_layer=2, n_head=2,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(config)

    ids = torch.randint(0, 50, (8, 8), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args, = ArgumentParser().parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path / "kw"), "--gradient_checkpointing", "--gradient_checkpointing_kwargs",
         '{"use_reentrant": false}', "--max_steps", "2", "--per_device_train_batch_size", "4", "--save_strategy",
         "no", "--report_to", "none", "--use_cpu", "--disable_tqdm", "true"])
    assert args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    checkpointed = Trainer(gpt2(), args, train_dataset=data)
    funcs = {m._gradient_checkpointing_func.keywords.get("use_reentrant") for m in checkpointed.model.modules()
             if getattr(m, "gradient_checkpointing", False)}
    assert funcs == {False}
    checkpointed.train()
    plain = Trainer(gpt2(), dataclasses.replace(args, output_dir=str(tmp_path / "plain"), gradient_checkpointing=False,
                                                gradient_checkpointing_kwargs=None), train_dataset=data)
    plain.train()
    for a, b in zip(checkpointed.model.parameters(), plain.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)

    def checkpointing(kwargs):  # which blocks recompute, with what checkpoint keywords (Transformers 5's rules)
        made = Trainer(gpt2(), dataclasses.replace(args, output_dir=str(tmp_path / "layers"),
                                                   gradient_checkpointing_kwargs=kwargs))
        return [(i, block._gradient_checkpointing_func.keywords) for i, block in enumerate(made.model.transformer.h)
                if block.gradient_checkpointing]

    # every_n_layers picks the blocks and never reaches torch.utils.checkpoint (it raised there); {} is None
    assert checkpointing({"every_n_layers": 2, "use_reentrant": False}) == [(0, {"use_reentrant": False})]
    assert checkpointing({}) == checkpointing(None)
