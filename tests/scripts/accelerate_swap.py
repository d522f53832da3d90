"""accelerate driving ddpkit's DDP in place of torch's: `Accelerator.prepare` builds the wrapper.

    accelerate launch --multi_gpu --num_processes 2 tests/scripts/accelerate_swap.py OUT

The same training three times in one launch: first with torch's DistributedDataParallel (the reference), then
with torch.nn.parallel.DistributedDataParallel swapped for ddpkit's, then with ddpkit's ZeroRedundancyOptimizer
too, so every place accelerate reaches for torch's wrapper (prepare, no_sync inside accumulate, unwrap_model,
trigger_sync_in_backward) meets ours; accelerate looks the class up there each time, so a swap after its import
reaches them all (one launch instead of three saves a launcher's and workers' imports). Each rank writes what it
saw and its final parameters to OUT/torch/rank<r>.json, OUT/ours/rank<r>.json and OUT/zero/rank<r>.json.
"""

import json
import os
import sys

import torch

import ddpkit
from accelerate import Accelerator


def train(out_dir: str, zero: bool = False) -> Accelerator:
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    optimizer = ddpkit.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1) if zero else \
        torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 6, generator=generator),
                                          torch.randint(0, 3, (64,), generator=generator))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    with accelerator.trigger_sync_in_backward(model):  # ours: reaches for model.reducer.prepare_for_backward
        pass
    unwrapped = accelerator.unwrap_model(model)
    report = {"wrapper": f"{type(model).__module__}.{type(model).__name__}",
              "unwrapped_is_inner": unwrapped is model.module, "world": accelerator.num_processes,
              "params": [p.detach().flatten().tolist() for p in unwrapped.parameters()]}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump(report, f)
    return accelerator


train(os.path.join(sys.argv[1], "torch"))
torch.nn.parallel.DistributedDataParallel = ddpkit.DistributedDataParallel
train(os.path.join(sys.argv[1], "ours"))
train(os.path.join(sys.argv[1], "zero"), zero=True).end_training()  # prepare reads its state_dict at once
