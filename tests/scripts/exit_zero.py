"""A rank that ends with exit code 0 while the others still train, for the launcher's summary.

    # rank 1 calls os._exit(0) at step 3 (a library that "exits cleanly"); rank 0 trains on and loses its peer
    ddpkit launch --nproc-per-node 2 tests/scripts/exit_zero.py --how os_exit --at-step 3
    ddpkit launch --nproc-per-node 2 tests/scripts/exit_zero.py --how sys_exit --at-step 0   # before any step

Training is ddpkit's DistributedDataParallel on a tiny linear model; prints `LEAVING <rank>` before rank 1 exits
and `STEP <n>` on rank 0 after each step.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import time

try:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: test hygiene, die with the launcher
except (OSError, AttributeError):
    pass

import torch

import ddpkit


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--how", choices=("os_exit", "sys_exit"), default="os_exit")
    parser.add_argument("--at-step", type=int, default=3, help="rank 1 exits before this step (0: before any)")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = ddpkit.init_process_group(backend="gloo", timeout=60)
    model = ddpkit.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(args.steps):
        if world.rank == 1 and step == args.at_step:
            print(f"LEAVING {world.rank} {time.time():.3f}", flush=True)
            if args.how == "os_exit":
                os._exit(0)
            sys.exit(0)
        model(torch.randn(8, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if world.rank == 0:
            print(f"STEP {step}", flush=True)
        time.sleep(0.05)
    ddpkit.destroy_process_group()


if __name__ == "__main__":
    main()
