"""Is a checkpoint folder whole? Checks that name the file and what is wrong with it.

A checkpoint is finished when its completion marker, ``checkpoint_complete.json``, exists: it is written last,
after every other file was written and fsynced, and lists each file with its size in bytes and its CRC-32:

    {"format": 2, "step": 120, "files": {"model.safetensors": 40312, ...}, "crc32": {"model.safetensors": 2961, ...}}

`problems(path)` compares a folder with its marker: each file must be there with its size; then it looks inside
each file just far enough to see truncation or garbage, without loading tensors (a safetensors header must parse
and account for the file's size, a torch file (a zip archive) must have a readable central directory (it sits at
the end, so a cut file loses it), a JSON file must parse); last, every byte is read once and checked against its
CRC-32, which catches what keeps the size and the structure (flipped bits inside the tensors' data). The writer
computes the checksums from the bytes as it writes them (`ChecksumWriter`), so a save reads nothing back but the
safetensors file. A format-1 marker (an older ddpkit's: sizes only) is checked without checksums; folders an even
older ddpkit wrote carry no marker: they are checked for the files every checkpoint has. Nothing here deletes or
changes anything. `write_failure` says why a write failed, a full disk in plain words, on whichever rank it was.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import zipfile
import zlib
from collections.abc import Callable
from typing import Any

from ddpkit.errors import CheckpointError

MARKER_FILE = "checkpoint_complete.json"
MARKER_FORMAT = 2  # 1: sizes only; 2: sizes and a "crc32" table
# zlib.crc32 ran at 2.1-2.9 GB/s on one core of the 2-core development machine (256 MiB from memory and from the
# page cache, in 4 MiB reads; 4 and 16 MiB chunks alike), about as fast as the page cache hands the bytes over:
# checking a checkpoint costs about 0.4 s per GB it holds, more when its files must come from disk. `problems`
# pays it only where a checkpoint is chosen (latest_valid_checkpoint, on rank 0, which stops at the newest whole
# one) or loaded (on every rank; the Trainer's ranks share out ZeRO's shards, checkpoint.check_loadable); finding,
# listing and rotating go by names.
CHUNK_BYTES = 4 * 1024 * 1024
# Files every checkpoint has, marker or not (the rest depend on what was saved: optimizer, scheduler, ...).
REQUIRED = ("model.safetensors", "trainer_state.json")


class ChecksumWriter:
    """A binary file that keeps the CRC-32 of what is written through it (`torch.save(obj, writer)` writes its
    zip records through `write`), so the checksum costs no second read of the file.

        with ChecksumWriter(path) as out:
            torch.save(state, out)
        crc = out.crc32
    """

    def __init__(self, path: str):
        self._file = open(path, "wb")  # noqa: SIM115 - closed by __exit__
        self.crc32 = 0

    def write(self, data: Any) -> int:
        self.crc32 = zlib.crc32(data, self.crc32)
        return self._file.write(data)

    def flush(self) -> None:
        self._file.flush()

    def __enter__(self) -> ChecksumWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()


def write_checksummed(path: str, write: Callable[[ChecksumWriter], Any]) -> int:
    """A new file at `path`, filled by write(file) (``functools.partial(torch.save, state)``); its CRC-32."""
    with ChecksumWriter(path) as out:
        write(out)
    return out.crc32


def file_crc32(file: str) -> int:
    """The CRC-32 of a file's bytes, read once in CHUNK_BYTES pieces."""
    crc, buffer = 0, bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with open(file, "rb", buffering=0) as f:
        while count := f.readinto(buffer):
            crc = zlib.crc32(view[:count], crc)
    return crc


def manifest(folder: str, names: list[str], step: int, crc32: dict[str, int] | None = None) -> dict:
    """The marker's content for the files `names` of `folder`, their sizes as they are on disk now.

    crc32: every file's CRC-32, as its writer computed it (a format-2 marker); without it, a format-1 marker of
    sizes only."""
    marker = {"format": 1, "step": step,
              "files": {name: os.path.getsize(os.path.join(folder, name)) for name in sorted(names)}}
    if crc32 is None:
        return marker
    missing = sorted(set(names) - set(crc32))
    if missing:
        raise ValueError(f"no checksum was computed for {', '.join(missing)}")
    return {**marker, "format": MARKER_FORMAT, "crc32": {name: crc32[name] for name in sorted(names)}}


def read_marker(path: str) -> dict | None:
    """The parsed marker of checkpoint folder `path`; None when there is none. Raises CheckpointError when it
    cannot be read."""
    marker = os.path.join(path, MARKER_FILE)
    if not os.path.isfile(marker):
        return None
    try:
        with open(marker, encoding="utf-8") as f:
            found = json.load(f)
        if not isinstance(found, dict) or not isinstance(found.get("files"), dict):
            raise ValueError("no 'files' table")
        sums = found.get("crc32")
        if found.get("format", 1) != 1 and not (isinstance(sums, dict) and set(found["files"]) <= set(sums) and
                                                 all(isinstance(crc, int) for crc in sums.values())):
            raise ValueError(f"format {found.get('format')!r} without a checksum for every file")
        return found
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{MARKER_FILE} cannot be read ({exc})") from exc


def problems(path: str, checksum: Callable[[str], bool] = lambda name: True) -> list[str]:
    """What is wrong with checkpoint folder `path` (each entry names a file); empty when it looks whole.
    checksum(name): whether to read that file whole for its CRC-32 (the cheap checks run on every file)."""
    try:
        marker = read_marker(path)
    except CheckpointError as exc:
        return [str(exc)]
    found: list[str] = []
    # An older ddpkit's folder has no marker: only the files every checkpoint has can be asked for.
    expected = dict.fromkeys(REQUIRED) if marker is None else marker["files"]
    sums = {} if marker is None else marker.get("crc32") or {}  # a format-1 marker has sizes only
    for name, size in expected.items():
        problem = _file_problem(os.path.join(path, name), size, sums.get(name) if checksum(name) else None)
        if problem is not None:
            found.append(f"{name} {problem}")
    return found


def _file_problem(file: str, size: int | None, crc: int | None) -> str | None:
    """What is wrong with one file, the cheap checks first; None when it is as written."""
    if not os.path.isfile(file):
        return "is missing"
    actual = os.path.getsize(file)
    if size is not None and actual != size:
        return f"has {actual} bytes where {size} were written (truncated or overwritten)"
    problem = _content_problem(file)
    if problem is None and crc is not None:
        try:
            got = file_crc32(file)
        except OSError as exc:
            return f"cannot be read ({exc})"
        if got != crc:
            problem = (f"fails its checksum (CRC-32 {got:08x} where {crc:08x} was written): its bytes changed "
                       "after the save (a disk or copy error)")
    return problem


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


# torch's zip writer reports a failed write as its own error; the OSError with its errno comes along only as the
# context when it wrote through a Python file (ChecksumWriter), not when it wrote to a path itself.
_WRITER_FAILURES = ("unexpected pos", "file write failed", "No space left")
_FULL_WORDS = ("No space left on device", "Disk quota exceeded")
LOW_SPACE_BYTES = 16 * 1024 * 1024  # below this much free space, a failed write is taken for a full disk


def write_failure(exc: BaseException, output_dir: str) -> str:
    """What to tell every rank about a failed write into output_dir: a full disk in plain words, anything else
    as it came."""
    chain, seen = [], exc
    while seen is not None:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    full = any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in chain)
    # safetensors' writer (Rust) gives only the system's words: a quota's "Disk quota exceeded (os error 122)".
    full = full or any(words in str(e) for e in chain for words in _FULL_WORDS)
    if not full and any(marker in str(e) for e in chain for marker in _WRITER_FAILURES):
        try:
            full = shutil.disk_usage(output_dir).free < LOW_SPACE_BYTES
        except OSError:
            pass
    if full:
        return (f"no space left on device: the file system of {os.path.abspath(output_dir)} is full (or the disk "
                "quota there is used up). The older checkpoints were kept and nothing half-written was left "
                "behind. Free some space, lower save_total_limit, or point output_dir at a larger disk")
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
