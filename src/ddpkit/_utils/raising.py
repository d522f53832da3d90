"""Raising across threads and warning at the user's line: small helpers the stall inspector and the engine share."""

from __future__ import annotations

import ctypes
import os
import sys
import threading


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


def callers_level() -> int:
    """The warnings stacklevel, seen from the caller of this function, of the innermost frame outside ddpkit and
    torch: the user's line (that called init_process_group, or ran backward: the reducer is called in from the
    autograd engine)."""
    torch = sys.modules.get("torch")
    roots = [os.path.dirname(os.path.dirname(__file__))]  # ddpkit/ (this file is ddpkit/_utils/raising.py)
    if getattr(torch, "__file__", None):
        roots.append(os.path.dirname(torch.__file__))
    inside = tuple(root + os.sep for root in roots)
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        level, frame = level + 1, frame.f_back
    return level if frame is not None else 1
