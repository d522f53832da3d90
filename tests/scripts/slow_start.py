"""Workers that start slowly, for the test of a launcher killed while they start (tests/distributed/test_launcher_watch.py).

    ddpkit launch --nproc-per-node 2 tests/scripts/slow_start.py --go /tmp/go

Every rank prints `STARTED <rank> <pid>` and imports ddpkit. Rank 0 then prints `JOINING 0` and joins the process
group at once (and waits there for rank 1); rank 1 first waits until the file --go names exists: a launcher killed
before that happens is gone before rank 1's init_process_group, which is where ddpkit starts watching it. After the
init both print `TRAINING <rank>` each second until stopped. The script sets no PR_SET_PDEATHSIG: only ddpkit may
stop them.
"""

import argparse
import os
import time

rank = int(os.environ["RANK"])
print(f"STARTED {rank} {os.getpid()}", flush=True)
parser = argparse.ArgumentParser()
parser.add_argument("--go", required=True)
args = parser.parse_args()

import ddpkit  # noqa: E402 - after STARTED: the test may kill the launcher while this imports torch

while rank == 1 and not os.path.exists(args.go):
    time.sleep(0.05)
print(f"JOINING {rank}", flush=True)
world = ddpkit.init_process_group(backend="gloo", timeout=600)
while True:
    print(f"TRAINING {world.rank}", flush=True)
    time.sleep(1)
