"""The interpreter exits while the stall inspector's thread polls its store (no destroy_process_group, no stop):
the inspector must stop itself first. Before it did, the thread was killed inside a store call as it took the
GIL back ("terminate called without an active exception", SIGABRT) in about half of the runs.

    python tests/scripts/exit_while_polling.py      # prints "exiting", exits 0
"""
import datetime
import time

import torch.distributed as dist

from torch.distributed.elastic.utils.distributed import get_free_port
from ddpkit.doctor.inspector import StallMonitor

# A TCPStore server in this process, and a client for the inspector, which polls it as fast as it can.
port = get_free_port()
server = dist.TCPStore("127.0.0.1", port, 1, True, datetime.timedelta(seconds=10))
client = dist.TCPStore("127.0.0.1", port, 1, False, datetime.timedelta(seconds=10))
monitor = StallMonitor(client, rank=0, world_size=1, threshold_s=60, poll_s=0.0001)
time.sleep(0.3)
print("exiting", flush=True)
# no destroy_process_group, no stop(): the interpreter exits while the thread polls
