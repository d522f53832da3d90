"""ddpkit's own errors of a distributed job, and a worker's uncaught exception written where torchelastic's
agent looks for it. This module imports nothing of ddpkit (nor torch), so every layer may raise these.

Under `ddpkit launch` or `torchrun` every worker gets ``TORCHELASTIC_ERROR_FILE``. When the worker dies of an
exception, the launcher reads that file and shows the traceback as the job's root cause; without it, all it
knows is "exit code 1". torch's way is the ``@record`` decorator on the user's ``main``; ddpkit needs no
decorator: `install_worker_excepthook()` (called by ``ddpkit.init_process_group``) chains a ``sys.excepthook``
that writes the file, then prints the traceback as usual.

The file's format is the one ``torch.distributed.elastic.multiprocessing.errors.ProcessFailure`` parses::

    {"message": {"message": "ValueError: bad shape",
                 "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1718000000"}}}
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import os
import sys
import threading
import time
import traceback
from types import TracebackType

from .atomic import replacing

ERROR_FILE_VAR = "TORCHELASTIC_ERROR_FILE"


class StallError(RuntimeError):
    """A collective timed out; the message says which ranks did not arrive and what they were doing."""


class PeerFailedError(RuntimeError):
    """Another rank of the job failed; raised in this rank's main thread."""


class DeadlockError(StallError):
    """Every rank is blocked in collectives that can never complete (an order mismatch, or a rank that left);
    the message names what each rank called and from which line."""


class PeerLeftError(RuntimeError):
    """A rank left the process group (it exited without an error, or destroyed the group) while this rank
    still needed it; the message names that rank and the last collective it took part in."""


class PeerVanishedError(PeerLeftError):
    """A rank's process ended without telling the others of an error or that it left (os._exit, a signal such
    as SIGKILL, the out-of-memory killer), or the store its host kept went with it, while this rank still needed
    it; the message names it and where it was.
    Not counted among EXPLAINING_ERRORS: a rank killed by a signal is its own root cause, and the launcher
    names it; so is one that exited with code 0 while the others still ran (ddpkit.summary), with this error's
    account of where it was printed after it."""


# The names of the errors that explain a failure rather than suffer it: the launcher's root-cause logic counts
# a traceback that ends in one of them as the cause, even though it also quotes the peer's closed connection.
EXPLAINING_ERRORS = ("DeadlockError", "PeerLeftError")

_installed = False


def raise_in_thread(thread: threading.Thread, kind: type[BaseException]) -> None:
    """Raise `kind` in `thread` the next time it runs Python code (a peer's failure, in the main thread). Python
    raises a class there, made without arguments: `carrying` gives it a message."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(kind))


def carrying(kind: type[BaseException], message: str) -> type[BaseException]:
    """A subclass of `kind`, named like it, whose instances made without arguments carry `message`; they pickle
    as plain `kind` instances."""

    def __init__(self: BaseException, *args: object) -> None:
        kind.__init__(self, *(args or (message,)))

    def __reduce__(self: BaseException) -> tuple:
        return kind, self.args, self.__dict__ or None  # its notes (add_note) too

    return type(kind.__name__, (kind,), {"__init__": __init__, "__reduce__": __reduce__,
                                         "__module__": kind.__module__, "__qualname__": kind.__qualname__})


def error_record(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> dict:
    """The error file's content for one exception, in torchelastic's schema."""
    return {
        "message": {
            "message": f"{exc_type.__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(exc_type, exc, tb)),
                # torchelastic parses an integer number of seconds; it orders failures by it
                "timestamp": str(int(time.time())),
            },
        }
    }


def message_record(text: str) -> dict:
    """The error file's content for an error that is a message, not an exception (shown as it is)."""
    return {"message": {"message": text.strip().splitlines()[0] if text.strip() else text,
                        "extraInfo": {"py_callstack": text.rstrip(), "timestamp": str(int(time.time()))}}}


def write_error_file(path: str, record: dict) -> bool:
    """Write `record` to `path` unless a record is already there; True when written.

    An existing file means torch's own ``@record`` already wrote this same exception, so it is kept. The write
    goes through a temporary file and a rename so the agent never reads half a file.
    """
    if os.path.exists(path):
        return False
    with replacing(path) as fp:
        json.dump(record, fp)
    return True


def record_unraised(exc: BaseException, stack: str) -> bool:
    """Write `exc` to ``TORCHELASTIC_ERROR_FILE`` (when set) as the cause of this worker's end, though it was
    never raised: the main thread is stuck in C++ and another thread ends the process. `stack` is the main
    thread's Python stack, shown as its traceback."""
    path = os.environ.get(ERROR_FILE_VAR)
    if not path:
        return False
    record = error_record(type(exc), exc, None)
    record["message"]["extraInfo"]["py_callstack"] = (
        f"Traceback of the main thread, which this error stopped (most recent call last):\n{stack}"
        f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}\n")
    try:
        return write_error_file(path, record)
    except OSError:
        return False


def _excepthook(previous):
    def hook(exc_type, exc, tb):
        path = os.environ.get(ERROR_FILE_VAR)
        if path:
            try:
                write_error_file(path, error_record(exc_type, exc, tb))
            except OSError as err:  # never hide the user's exception behind ours
                print(f"ddpkit: could not write the error file {path}: {err}", file=sys.stderr)
        previous(exc_type, exc, tb)

    hook.ddpkit_hook = True
    return hook


def install_worker_excepthook() -> bool:
    """Record this process's uncaught exception in ``TORCHELASTIC_ERROR_FILE``; True if newly installed.

    A no-op outside a torchelastic launcher (no such variable) and on a second call. Also turns on
    ``faulthandler``, so a worker that dies of SIGSEGV or SIGABRT prints every thread's Python stack first.
    """
    global _installed
    if _installed or not os.environ.get(ERROR_FILE_VAR):
        return False
    if not getattr(sys.excepthook, "ddpkit_hook", False):
        sys.excepthook = _excepthook(sys.excepthook)
    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)
    _installed = True
    return True


def callers_level() -> int:
    """The warnings stacklevel, seen from the caller of this function, of the innermost frame outside ddpkit and
    torch: the user's line (that called init_process_group, or ran backward: the reducer is called in from the
    autograd engine)."""
    torch = sys.modules.get("torch")
    inside = tuple(os.path.dirname(path) + os.sep for path in (__file__, getattr(torch, "__file__", None)) if path)
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        level, frame = level + 1, frame.f_back
    return level if frame is not None else 1
