"""A worker's uncaught exception, written where torchelastic's agent looks for it.

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

import faulthandler
import json
import os
import sys
import time
import traceback
from types import TracebackType

from ddpkit._utils.atomic import replacing

ERROR_FILE_VAR = "TORCHELASTIC_ERROR_FILE"
_installed = False


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
