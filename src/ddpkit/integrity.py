"""Is a checkpoint folder whole? Cheap checks that name the file and what is wrong with it.

A checkpoint is finished when its completion marker, ``checkpoint_complete.json``, exists: it is written last,
after every other file was written and fsynced, and lists each file with its size in bytes:

    {"format": 1, "step": 120, "files": {"model.safetensors": 40312, "optimizer.pt": 80925, ...}}

`problems(path)` compares a folder with its marker and looks inside each file just far enough to see truncation
or garbage, without loading tensors: a safetensors header must parse and account for the file's size, a torch
file (a zip archive) must have a readable central directory (it sits at the end, so a cut file loses it), a JSON
file must parse. Folders an older ddpkit wrote carry no marker: they are checked for the files every checkpoint
has. Nothing here deletes or changes anything. `write_failure` says why a write failed, a full disk in plain words,
on whichever rank it was.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import zipfile

MARKER_FILE = "checkpoint_complete.json"
MARKER_FORMAT = 1
# Files every checkpoint has, marker or not (the rest depend on what was saved: optimizer, scheduler, ...).
REQUIRED = ("model.safetensors", "trainer_state.json")


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete or corrupt, or could not be written; the message names the file."""


def manifest(folder: str, names: list[str], step: int) -> dict:
    """The marker's content for the files `names` of `folder`, as they are on disk now."""
    return {"format": MARKER_FORMAT, "step": step,
            "files": {name: os.path.getsize(os.path.join(folder, name)) for name in sorted(names)}}


def read_marker(path: str) -> dict | None:
    """The parsed marker of checkpoint folder `path`; None when there is none. Raises CheckpointError when it
    cannot be read."""
    marker = os.path.join(path, MARKER_FILE)
    if not os.path.isfile(marker):
        return None
    try:
        with open(marker, encoding="utf-8") as f:
            found = json.load(f)
        if not isinstance(found.get("files"), dict):
            raise ValueError("no 'files' table")
        return found
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{MARKER_FILE} cannot be read ({exc})") from exc


def problems(path: str) -> list[str]:
    """What is wrong with checkpoint folder `path` (each entry names a file); empty when it looks whole."""
    try:
        marker = read_marker(path)
    except CheckpointError as exc:
        return [str(exc)]
    found: list[str] = []
    # An older ddpkit's folder has no marker: only the files every checkpoint has can be asked for.
    expected = dict.fromkeys(REQUIRED) if marker is None else marker["files"]
    for name, size in expected.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            found.append(f"{name} is missing")
            continue
        actual = os.path.getsize(file)
        if size is not None and actual != size:
            found.append(f"{name} has {actual} bytes where {size} were written (truncated or overwritten)")
            continue
        problem = _content_problem(file)
        if problem is not None:
            found.append(f"{name} {problem}")
    return found


def _content_problem(file: str) -> str | None:
    """Why `file` cannot be what its extension says, judged from its structure alone; None when it can."""
    try:
        if file.endswith(".safetensors"):
            return _safetensors_problem(file)
        if file.endswith((".pt", ".pth")):
            with zipfile.ZipFile(file) as archive:  # reads the central directory at the end of the file
                archive.namelist()
            return None
        if file.endswith(".json"):
            with open(file, encoding="utf-8") as f:
                json.load(f)
            return None
    except (OSError, ValueError, zipfile.BadZipFile, UnicodeDecodeError) as exc:
        return f"is corrupt or truncated ({type(exc).__name__}: {exc})"
    return None


def _safetensors_problem(file: str) -> str | None:
    """safetensors: an 8-byte little-endian header length, a JSON header, then the tensors' bytes."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"is truncated ({size} bytes, not even a header)"
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            return f"is truncated (its header alone claims {length} bytes, the file has {size})"
        header = json.loads(f.read(length))
    ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    needed = 8 + length + max(ends, default=0)
    if needed > size:
        return f"is truncated ({size} bytes where its tensors need {needed})"
    return None


# torch's zip writer reports a full disk as its own error, without the OSError's errno.
_WRITER_FAILURES = ("unexpected pos", "file write failed", "No space left")
LOW_SPACE_BYTES = 16 * 1024 * 1024  # below this much free space, a failed write is taken for a full disk


def write_failure(exc: BaseException, output_dir: str) -> str:
    """What to tell every rank about a failed write into output_dir: a full disk in plain words, anything else
    as it came."""
    chain, seen = [], exc
    while seen is not None:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    full = any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in chain)
    if not full and any(marker in str(e) for e in chain for marker in _WRITER_FAILURES):
        try:
            full = shutil.disk_usage(output_dir).free < LOW_SPACE_BYTES
        except OSError:
            pass
    if full:
        return (f"no space left on device: the file system of {os.path.abspath(output_dir)} is full. The older "
                "checkpoints were kept and nothing half-written was left behind. Free some space, lower "
                "save_total_limit, or point output_dir at a larger disk")
    return f"{type(exc).__name__}: {exc}"


def write_failures(final: str, failures: list[tuple[int, str]]) -> CheckpointError:
    """One error for every rank's failed write of checkpoint `final` ((rank, write_failure's text) pairs), the
    ranks that failed alike named together."""
    ranks_of: dict[str, list[int]] = {}
    for rank, text in failures:
        ranks_of.setdefault(text, []).append(rank)
    return CheckpointError("; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} could not write checkpoint {final}: {text}"
        for text, ranks in ranks_of.items()))
