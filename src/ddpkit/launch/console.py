"""The launcher's console: every rank's output file, tailed as it grows, onto the launcher's stdout with a rank
prefix at the start of each line.

    console = Console(sys.stdout)                  # a terminal, or a pipe / log file
    tail = Tail(console, interval_s=0.05)
    tail.follow(rank=0, path="logs/rank0.log")    # for every rank of every attempt
    ...                                            # the job runs
    tail.stop()                                    # reads every file to its end first

Lines are forwarded as they are written, not only at their newline, so a progress bar that redraws its line
with carriage returns redraws in place on a terminal: the newest unfinished line of a rank is the "status"
line at the bottom, and every finished line of any rank is printed above it. Into a pipe or a file nothing
unfinished is written: a line appears once, when it ends, showing what a terminal would show at its end
(after its last carriage return), so a bar that redraws itself N times costs one line, not N.

A line a worker already prefixed with its own rank (torch's excepthook writes "[rank1]: " before every line
of a traceback) keeps one prefix, never two.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

PREFIX = "[rank{rank}]: "
# ECMA-48 "erase in line" (to its end): what is left of a longer status line must not show behind a shorter one.
ERASE_LINE = "\r\x1b[K"
# The width assumed when the terminal cannot say (a pseudo-terminal without a size).
DEFAULT_COLUMNS = 80
CHUNK_BYTES = 1 << 16


def shown_line(line: str) -> str:
    """What a terminal shows of a line that was redrawn with carriage returns: the part after the last one."""
    line = line.rstrip("\r")  # "\r\n" ends a line, it redraws nothing
    return line[line.rfind("\r") + 1:]


class Console:
    """Where the ranks' text goes; thread-safe (one tail thread per file feeds it)."""

    def __init__(self, out: TextIO, terminal: bool | None = None, columns: int | None = None):
        self.out = out
        self.terminal = _isatty(out) if terminal is None else terminal
        self.columns = columns or (shutil.get_terminal_size((DEFAULT_COLUMNS, 24)).columns if self.terminal
                                   else None)
        self._partial: dict[int, str] = {}  # rank -> its unfinished line, as written so far
        self._status: int | None = None  # the rank whose unfinished line is drawn at the bottom
        self._lock = threading.Lock()
        self._gone = False  # the reader went away (`ddpkit launch ... | head`): nothing more is written

    def feed(self, rank: int, text: str) -> None:
        """Text a rank wrote (any piece of it: lines, part of a line, carriage returns)."""
        if not text or self._gone:
            return
        with self._lock, self._unless_gone():
            *lines, rest = (self._partial.pop(rank, "") + text).split("\n")
            for line in lines:
                if self._status == rank:
                    self._status = None  # its line is finished: printed below, not as the status any more
                self._print_line(rank, shown_line(line))
            if rest:
                # Only what follows its last carriage return can still show: a bar redrawn a million times into
                # a pipe holds one drawing, not a million.
                cut = rest.rstrip("\r").rfind("\r")
                self._partial[rank] = rest[cut:] if cut > 0 else rest
                if self.terminal:
                    self._status = rank
            self._draw_status()
            self.out.flush()

    def close(self, rank: int | None = None) -> None:
        """Print what is left unfinished as lines (a worker that died mid-line), leaving the cursor on a new line;
        `rank`: only that rank's (its next attempt starts a new line)."""
        with self._lock, self._unless_gone():
            for unfinished in sorted(self._partial) if rank is None else [rank] if rank in self._partial else []:
                self._status = None
                self._print_line(unfinished, shown_line(self._partial.pop(unfinished)))
            self.out.flush()

    @contextlib.contextmanager
    def _unless_gone(self) -> Iterator[None]:
        """A closed pipe ends the console's output, quietly: the job goes on (a traceback from each tail thread
        said only that `head` had read enough)."""
        try:
            yield
        except BrokenPipeError:
            self._gone = True
            if self.out is sys.stdout:  # Python's own flush at exit would complain again
                with contextlib.suppress(OSError, ValueError):
                    devnull = os.open(os.devnull, os.O_WRONLY)
                    os.dup2(devnull, sys.stdout.fileno())
                    os.close(devnull)

    def _prefixed(self, rank: int, text: str) -> str:
        prefix = PREFIX.format(rank=rank)
        # torch's excepthook (and a nested launcher) prefix the rank themselves: keep one.
        while text.startswith(prefix.rstrip()):
            text = text[len(prefix.rstrip()):]
            text = text[1:] if text.startswith(" ") else text  # the one space after that prefix, not the indent
        return prefix + text

    def _print_line(self, rank: int, text: str) -> None:
        if self.terminal:
            self.out.write(ERASE_LINE)  # over the status line, which is redrawn below
        self.out.write(self._prefixed(rank, text) + "\n")

    def _draw_status(self) -> None:
        if self._status is None:
            return
        line = self._prefixed(self._status, shown_line(self._partial[self._status]))
        # One row only: a status line that wrapped could not be redrawn in place by a carriage return.
        self.out.write(ERASE_LINE + line[:max(1, self.columns - 1)])


def _isatty(out: TextIO) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):
        return False


class Tail:
    """Follows output files as they grow, in threads, and hands what they gain to a Console."""

    def __init__(self, console: Console, interval_s: float = 0.05):
        self.console = console
        self.interval_s = interval_s
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()

    def follow(self, rank: int, path: str) -> None:
        """Forward `path` (which may not exist yet) as rank `rank`'s output until `stop`."""
        thread = threading.Thread(target=self._follow, args=(rank, path), daemon=True,
                                  name=f"ddpkit-tail-rank{rank}")
        self._threads.append(thread)
        thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Forward what every file still holds, then stop; unfinished lines are printed as lines."""
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout_s)
        self.console.close()

    def _follow(self, rank: int, path: str) -> None:
        while not os.path.exists(path):
            if self._stopping.is_set():
                return
            time.sleep(self.interval_s)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.console.close(rank)  # a line an earlier attempt of this rank left unfinished is not continued here
        with open(path, "rb") as f:
            while True:
                chunk = f.read(CHUNK_BYTES)
                if chunk:
                    self.console.feed(rank, decoder.decode(chunk))
                elif self._stopping.is_set():
                    self.console.feed(rank, decoder.decode(b"", final=True))
                    return
                else:
                    time.sleep(self.interval_s)


__all__ = ["Console", "PREFIX", "Tail"]
