"""A tiny data-parallel training run that must end the same under every launcher.

    ddpkit launch --nproc-per-node 2 tests/scripts/train_tiny.py --out /tmp/run
    torchrun --nproc-per-node 2 tests/scripts/train_tiny.py --out /tmp/run
    accelerate launch --multi_gpu --num_processes 2 tests/scripts/train_tiny.py --out /tmp/run
    python tests/scripts/train_tiny.py --out /tmp/run                  # a world of one

Every step uses the same global batch of GLOBAL_BATCH samples, split evenly over the ranks; each rank takes the
mean loss over its share and DDP averages the gradients, so any world size that divides GLOBAL_BATCH follows the
same trajectory as one process on the whole batch (up to float rounding). Each rank writes its final parameters
to OUT/rank<R>.json. The other flags make a worker misbehave on purpose, for the launcher's tests.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
import time

import torch

import ddpkit

GLOBAL_BATCH = 8


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", help="directory for rank<R>.json with the final parameters")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--print-env", action="store_true", help="print the launcher's variables and sockets")
    parser.add_argument("--fail-rank", type=int, default=-1, help="this rank fails at --fail-step")
    parser.add_argument("--fail-step", type=int, default=2)
    parser.add_argument("--fail-how", choices=("raise", "sigkill"), default="raise")
    parser.add_argument("--fail-attempts", type=int, default=99, help="fail only on restarts below this")
    parser.add_argument("--wait-for-signal", action="store_true", help="print 'ready', then sleep until signalled")
    parser.add_argument("--ignore-term", action="store_true", help="on SIGTERM/SIGINT, keep sleeping")
    parser.add_argument("--remake", type=int, default=0,
                        help="destroy the process group and make it again this many times before training")
    return parser.parse_args()


def die_with_parent() -> None:
    """Test hygiene: if the launcher is SIGKILLed, take this worker down too (Linux only)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def listening_addresses(port: int) -> list[str]:
    """The local addresses of the TCP sockets listening on `port` in this network namespace."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fp:
                rows = fp.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            addr, hexport = fields[1].split(":")
            if fields[3] == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
                found.append(addr)
    return found


def print_env(rank: int) -> None:
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
             "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
             "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_ERROR_FILE",
             "OMP_NUM_THREADS")
    env = {name: os.environ.get(name) for name in names}
    if env["MASTER_PORT"]:
        env["store_listen"] = listening_addresses(int(env["MASTER_PORT"]))
    print("ENV " + json.dumps(env), flush=True)
    print(f"to stderr from rank {rank}", file=sys.stderr, flush=True)


def wait_for_signal(rank: int, ignore: bool) -> None:
    def handler(signum, frame):
        print(f"rank {rank} got {signal.Signals(signum).name}", flush=True)
        if not ignore:
            sys.exit(0)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    print(f"rank {rank} ready pid {os.getpid()}", flush=True)
    while True:
        time.sleep(0.1)


def remake(times: int) -> ddpkit.DistEnv:
    """Destroy the process group and make it again, `times` times (a sweep of runs in one script does so), each
    group checked with an all-reduce of rank + 1."""
    for time_ in range(1, times + 1):
        ddpkit.destroy_process_group()
        world = ddpkit.init_process_group(backend="gloo", timeout=60)
        total = torch.tensor([world.rank + 1.0])
        torch.distributed.all_reduce(total)
        print(f"remade {time_}: rank {world.rank} sums {int(total.item())}", flush=True)
    return world


def main() -> None:
    args = parse_args()
    die_with_parent()
    from ddpkit.distributed.error_file import install_worker_excepthook

    install_worker_excepthook()  # ddpkit.init_process_group will do this itself
    torch.set_num_threads(1)
    world = ddpkit.init_process_group(backend="gloo", timeout=60)
    if args.print_env:
        print_env(world.rank)
    if args.wait_for_signal:
        wait_for_signal(world.rank, args.ignore_term)
    if args.remake:
        world = remake(args.remake)

    torch.manual_seed(0)  # the same initial model and data on every rank
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    ddp_cls = getattr(ddpkit, "DistributedDataParallel", None) or torch.nn.parallel.DistributedDataParallel
    ddp = ddp_cls(model) if world.is_distributed else model
    # Plain SGD written out, not torch.optim.SGD: an optimizer's first use imports torch._dynamo, 3-4 s of CPU in
    # every worker of the twenty-odd launches of tests/launch/test_launcher.py, and the launchers, not the optimizer, are
    # what those tests compare. The update is the same for every launcher and world size.
    lr = 0.1
    data = torch.randn(args.steps, GLOBAL_BATCH, 4)
    target = torch.randn(args.steps, GLOBAL_BATCH, 1)
    share = GLOBAL_BATCH // world.world_size  # each rank's slice of the global batch
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for step in range(args.steps):
        if world.rank == args.fail_rank and step == args.fail_step and attempt < args.fail_attempts:
            print(f"FAILING rank {world.rank} at {time.time():.3f}", flush=True)
            if args.fail_how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError(f"rank {world.rank} fails on purpose at step {step}")
        rows = slice(world.rank * share, (world.rank + 1) * share)
        loss = torch.nn.functional.mse_loss(ddp(data[step, rows]), target[step, rows])
        for p in model.parameters():
            p.grad = None
        loss.backward()  # DDP averages the gradients over ranks: the gradient of the global-batch mean loss
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-lr)
    params = [p.detach().flatten().tolist() for p in model.parameters()]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"rank{world.rank}.json"), "w") as fp:
            json.dump({"world_size": world.world_size, "launcher": world.launcher, "params": params}, fp)
    print(f"done rank {world.rank} of {world.world_size}", flush=True)
    ddpkit.destroy_process_group()


if __name__ == "__main__":
    main()
