"""What one collective is, apart from the Comm that issues it: its record, the observer protocol that hears of it,
the handle of one in flight, and how many tensors travel as one message.

`ddpkit.comm.Comm` is the only caller of collectives; this module calls none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

# Tensors are broadcast in flat chunks of at most this size; torch uses the same 250 MiB for its init broadcast.
BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024


@dataclasses.dataclass
class CollectiveRecord:
    seq: int  # position in this group's sequence, the same collective on every rank (1, 2, ...)
    op: str  # all_reduce, broadcast, barrier, ..., comm_hook (a hook's, from `note`), future (unknown)
    what: str  # what it is for: "bucket 3, backward 7", "logged loss"
    nbytes: int  # bytes this rank contributes (all_gather: what it receives)
    started: float  # time.monotonic() when it was issued


class CommObserver:
    """What a `Comm` tells its observers; subclass and override any of these (each default does nothing).

    Calls come in this order for one collective: `issued`, then for each wait on it `wait_began` and
    `wait_ended` (none for an asynchronous one nobody waits for), and `finished` once, possibly before the wait
    ends and from another thread. Observers must be quick: they run on the training step's path.
    """

    def issued(self, record: CollectiveRecord) -> None:
        """`record` was numbered and is about to be launched (main thread)."""

    def wait_began(self, record: CollectiveRecord) -> None:
        """The main thread starts blocking on `record`."""

    def wait_ended(self, record: CollectiveRecord, error: BaseException | None) -> BaseException | None:
        """The main thread stopped blocking on `record`; `error` is what the wait raised (None: it succeeded).

        Return an exception to raise instead of `error` (an explanation of it), or None to leave it as it is.
        """
        return None

    def finished(self, record: CollectiveRecord, error: BaseException | None) -> None:
        """`record` completed (`error` None) or failed. For an asynchronous collective this comes from the
        backend's thread as soon as it completes (a callback on its Work's future), waited for or not; for a
        blocking one, and a comm hook's future, when the wait returns."""

    def close(self) -> None:
        """The group is about to be destroyed (`destroy_process_group`): stop threads, flush files."""


@dataclasses.dataclass
class Pending:
    """An asynchronous collective in flight; `Comm.wait` waits for it."""

    work: Any
    record: CollectiveRecord


class _DoneWork:
    """The Work of a collective that needed no communication (a world of one)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self.tensor)
        return fut


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's contents as a flat uint8 tensor (a view when it is contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _chunks(tensors: list[torch.Tensor], cap_bytes: int) -> Iterator[list[torch.Tensor]]:
    chunk: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if chunk and size + nbytes > cap_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append(t)
        size += nbytes
    if chunk:
        yield chunk
