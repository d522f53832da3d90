"""The terminal a worker's output reaches. `ddpkit launch` forwards every worker's output (which goes to a file)
to its own stdout; when that is a terminal, it tells the workers how many columns they may use on it, so that a
progress bar can redraw in place there too."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from ddpkit.distributed.variables import CONSOLE_COLUMNS_VAR


def console_columns(stream: object = None, environ: Mapping[str, str] | None = None) -> int | None:
    """The width of the terminal that text written to `stream` (default: sys.stderr) reaches, or None when it
    reaches none (a pipe, a log file): the stream's own terminal, else the one `ddpkit launch` forwards it to."""
    stream = sys.stderr if stream is None else stream
    environ = os.environ if environ is None else environ
    try:
        if stream.isatty():
            return os.get_terminal_size(stream.fileno()).columns or 80  # a terminal of no size: assume 80
    except (AttributeError, OSError, ValueError):  # not a real file, or a terminal that cannot say its size
        pass
    value = environ.get(CONSOLE_COLUMNS_VAR, "")
    return int(value) if value.isdigit() and int(value) > 0 else None
