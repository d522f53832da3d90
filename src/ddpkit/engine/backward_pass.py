"""What the reducer knows about one backward pass (a BackwardPass), and the parameter uses between synchronisations.

A new `BackwardPass` is made for every backward pass and a new `Uses` after every synchronised one, so no state is
ever reset by hand: a backward that raised simply leaves its pass behind, and the next one starts clean.
"""

from __future__ import annotations

from typing import Any


class BackwardPass:
    """One backward pass, from its first autograd node to its finalize."""

    __slots__ = ("graph_task", "open", "sync", "divisor", "fires", "filled", "fired_order", "missing",
                 "next_launch", "launched_during_backward", "inflight", "usage", "usage_counts", "number", "began")

    def __init__(self, graph_task: int, began: float | None = None):
        self.graph_task = graph_task  # the autograd graph task that opened it
        self.began = began  # the timeline's start of this backward (None when no timeline records)
        self.open = True  # until its finalize ran (or the next backward found it abandoned)
        self.sync = False
        self.usage: Any = None  # the usage-count collective in flight (see Reducer._launch_usage)
        self.usage_counts: Any = None
        self.missing: list[int] = []
        self.inflight: list[Any] = []
        self.next_launch = 0

    def open_sync(self, num_params: int, buckets: list, divisor: float, number: int) -> None:
        """From here on this backward synchronises (a pass may start local and be joined by a synced output)."""
        self.sync = True
        self.number = number  # counts synchronised backward passes from 1, for naming its collectives
        self.divisor = divisor  # fixed for the pass: what every bucket is divided by
        self.fires = [0] * num_params  # gradient accumulations seen per parameter
        self.filled = [False] * num_params  # the gradient is already divided into its bucket view
        self.fired_order: list[int] = []  # the learning pass's ready order
        self.launched_during_backward = 0
        self.start_buckets(buckets)

    def start_buckets(self, buckets: list) -> None:
        self.missing = [len(bucket.members) for bucket in buckets]  # gradients each bucket still waits for
        self.inflight = [None] * len(buckets)  # each launched bucket's handle, until it is awaited
        self.next_launch = 0  # buckets launch strictly in index order


class Uses:
    """Which parameters got a gradient since the last synchronised backward (no_sync micro-batches included)."""

    __slots__ = ("flags", "count")

    def __init__(self, num_params: int):
        self.flags = [False] * num_params
        self.count = 0

    def mark(self, index: int) -> None:  # Reducer._on_grad inlines this
        if not self.flags[index]:
            self.flags[index] = True
            self.count += 1
