"""Files written whole or not at all: through a temporary beside the target, renamed over it once complete.

A reader (a resume, the launcher reading a worker's error file, a plot of metrics.jsonl) never sees half a
file: it sees the old file or the new one. The temporary sits in the target's folder, so the rename stays on one
file system (where it is atomic), and carries this process's pid and a random tag, so that two writers of one
path never share a temporary. When the writing or the rename fails (a full disk, a folder where the file should
be) the temporary is removed and the error names the target, not the temporary. `durable=True` also fsyncs the
file before the rename and the folder after it, so the new file survives a power cut once this returns
(checkpoints, the metrics a resume reads back); without it a crash of the machine, not of the process, may leave
the old file.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Iterator
from typing import IO, Any

from ddpkit._utils.procfs import process_ended

_TEMPORARY = re.compile(r"\.tmp-(\d+)-[0-9a-f]{8}$")


def temporary_name(path: str) -> str:
    return f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def left_behind(path: str) -> bool:
    """Whether `path` is a temporary of this module whose writer is gone from this machine (killed mid-write):
    debris to sweep (ddpkit.checkpoint.folders.remove_stale). A live writer's, or one whose pid was reused, stays."""
    match = _TEMPORARY.search(os.path.basename(path))
    if match is None or not os.path.isfile(path) or int(match.group(1)) == os.getpid():
        return False
    return process_ended(int(match.group(1)))


def fsync_path(path: str) -> None:
    """fsync a file or a folder (a folder's fsync makes the renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def replacing_path(path: str, durable: bool = False) -> Iterator[str]:
    """A temporary path to write `path` through (for writers that take a file name, such as safetensors')."""
    tmp = temporary_name(path)
    try:
        yield tmp
        if durable:
            fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(exc, OSError) and exc.errno is not None and exc.filename != path:
            raise OSError(exc.errno, exc.strerror, path) from exc  # the same subclass, for the file asked for
        raise
    if durable:
        fsync_path(os.path.dirname(path) or ".")


@contextlib.contextmanager
def replacing(path: str, mode: str = "w", durable: bool = False) -> Iterator[IO[Any]]:
    """An open file to write `path` through (module docstring); text modes write UTF-8."""
    with replacing_path(path, durable) as tmp:
        with open(tmp, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
