"""The rendezvous of `ddpkit launch`: torchelastic's, except on one node, where the store listens on loopback only
(torchrun's binds every interface) and every attempt gets a fresh store on a fresh port.

    handler = rendezvous_handler(plan)
"""

from __future__ import annotations

import socket

from ddpkit.launch.options import LaunchPlan


def _loopback_rendezvous(run_id: str, timeout_s: float):
    """torchelastic's static rendezvous for one node, its store listening on 127.0.0.1 only.

    TCPStore binds every interface when it opens its own socket; given a socket we bound to loopback
    (master_listen_fd) it serves on that one instead. Each attempt gets a fresh store on a fresh port, as torch
    intends ("we create a new TCPStore for every retry", torch/distributed/rendezvous.py): no key of a failed
    attempt (gloo's peer addresses, join counters, posted failures) can mislead the restarted workers.
    """
    import datetime

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    class LoopbackRendezvous(StaticTCPRendezvous):
        def __init__(self):
            super().__init__("127.0.0.1", 0, rank=0, world_size=1, run_id=run_id, timeout=int(timeout_s))
            self._servers: list[tuple[socket.socket, dist.TCPStore]] = []  # every attempt's, closed at the end

        def next_rendezvous(self) -> RendezvousInfo:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.bind(("127.0.0.1", 0))
            listener.listen(128)
            self.master_port = listener.getsockname()[1]
            store = dist.TCPStore("127.0.0.1", self.master_port, 1, True, datetime.timedelta(seconds=timeout_s),
                                  multi_tenant=True, master_listen_fd=listener.fileno())
            self._servers.append((listener, store))
            return RendezvousInfo(dist.PrefixStore(run_id, store), 0, 1,
                                  RendezvousStoreInfo("127.0.0.1", self.master_port))

        def shutdown(self) -> bool:
            for listener, _ in self._servers:
                listener.close()
            self._servers.clear()
            return True

    return LoopbackRendezvous()


def rendezvous_handler(plan: LaunchPlan):
    from torch.distributed.elastic.rendezvous import RendezvousParameters, registry

    if plan.rdzv_backend == "loopback":
        return _loopback_rendezvous(plan.run_id, float(plan.rdzv_configs["timeout"]))
    params = RendezvousParameters(backend=plan.rdzv_backend, endpoint=plan.rdzv_endpoint, run_id=plan.run_id,
                                  min_nodes=plan.min_nodes, max_nodes=plan.max_nodes,
                                  local_addr=plan.local_addr, **plan.rdzv_configs)
    return registry.get_rendezvous_handler(params)


__all__ = ["rendezvous_handler"]
