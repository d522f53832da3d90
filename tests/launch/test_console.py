"""What a person sees of a job's output: on a terminal (a pseudo-terminal, read back through a tiny terminal
emulation that applies carriage returns, newlines and erase-line) and in a pipe (its lines counted).

The unit tests feed ddpkit.launch.console.Console by hand; the others run tests/scripts/train_console.py (12 steps,
logging every 3, evaluating every 6, rank 1 printing a line a step) under `ddpkit launch` and plain python.
"""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from ddpkit.launch.console import Console
from helpers.world import clean_env, reap, two_at_a_time

SCRIPT = str(Path(__file__).parent.parent / "scripts" / "train_console.py")
LAUNCH = [sys.executable, "-m", "ddpkit", "launch", "--nproc-per-node", "2"]
COLUMNS = 120
DEADLINE_S = 120
STEPS, LOGGING_STEPS, EVALUATIONS = 12, 3, 2  # the script's defaults
CSI = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])")


def screen(raw: str) -> list[str]:
    """The rows a terminal shows after `raw`: \\r returns to column 0, \\n goes down a row, ESC[K erases to the
    end of the row, other escape sequences are ignored, and nothing wraps (the console keeps rows short)."""
    rows: list[list[str]] = [[]]
    row = col = 0
    i = 0
    while i < len(raw):
        match = CSI.match(raw, i)
        if match:
            if match.group(2) == "K":
                del rows[row][col:]
            i = match.end()
            continue
        ch = raw[i]
        if ch == "\r":
            col = 0
        elif ch == "\n":
            row, col = row + 1, 0
            if row == len(rows):
                rows.append([])
        elif ch >= " ":
            line = rows[row]
            line.extend(" " * (col - len(line)))
            if col < len(line):
                line[col] = ch
            else:
                line.append(ch)
            col += 1
        i += 1
    return ["".join(r).rstrip() for r in rows if "".join(r).strip()]


def run_in_terminal(argv: list[str], columns: int = COLUMNS) -> tuple[int, str]:
    """Run `argv` with a pseudo-terminal of `columns` columns as its stdout and stderr; its status and output."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {k: v for k, v in clean_env().items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True)
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + DEADLINE_S
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 1 << 16)
                except OSError:  # EIO: every holder of the terminal's other end has closed it
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        else:
            raise AssertionError(f"{argv} passed its {DEADLINE_S} s deadline:\n{b''.join(chunks).decode()}")
        return proc.wait(30), b"".join(chunks).decode(errors="replace")
    finally:
        reap(proc)
        os.close(master)


def run_into_pipe(argv: list[str]) -> tuple[int, str]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=clean_env(), text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=DEADLINE_S)
        return proc.returncode, out
    finally:
        reap(proc)


# -- the console by hand -------------------------------------------------------------------------------------------

def test_a_redrawn_line_stays_at_the_bottom_and_other_lines_print_above_it():
    out = io.StringIO()
    console = Console(out, terminal=True, columns=40)
    console.feed(0, "starting\n\rtrain 1/3")
    console.feed(1, "hello from rank 1\n")
    console.feed(0, "\rtrain 2/3")
    console.feed(1, "[rank1]: Traceback (torch's excepthook prefixes its lines)\n")
    console.feed(1, '[rank1]:   File "x.py", line 6\n[rank1]:     raise ValueError\n')  # indents kept
    console.feed(0, "\rtrain 3/3 " + "x" * 50)  # longer than the row: cut, never wrapped
    console.feed(0, "\rtrain 3/3\n")
    console.close()
    assert screen(out.getvalue()) == ["[rank0]: starting", "[rank1]: hello from rank 1",
                                      "[rank1]: Traceback (torch's excepthook prefixes its lines)",
                                      '[rank1]:   File "x.py", line 6', "[rank1]:     raise ValueError",
                                      "[rank0]: train 3/3"]


def test_a_restarted_rank_starts_a_new_line(tmp_path):
    """A worker that died mid-line, then its next attempt's first line: two lines, not one glued (launch review)."""
    from ddpkit.launch.console import Tail

    out = io.StringIO()
    tail = Tail(Console(out, terminal=False))
    first, second = tmp_path / "rank0.log", tmp_path / "rank0.restart1.log"
    first.write_text("attempt 0: loading data... ")
    tail.follow(0, str(first))
    deadline = time.monotonic() + 10
    while "attempt 0" not in str(tail.console._partial.get(0)) and time.monotonic() < deadline:
        time.sleep(0.02)
    second.write_text("attempt 1: started fresh\n")
    tail.follow(0, str(second))
    tail.stop()
    assert out.getvalue().splitlines() == ["[rank0]: attempt 0: loading data... ", "[rank0]: attempt 1: started fresh"]


def test_into_a_pipe_a_redrawn_line_is_one_line_when_it_ends():
    out = io.StringIO()
    console = Console(out, terminal=False)
    for i in range(1000):
        console.feed(0, f"\rtrain {i}/1000")
    console.feed(1, "a line\r\n")
    console.feed(0, "\n")
    console.feed(1, "cut off by a crash")
    console.close()
    assert out.getvalue().splitlines() == ["[rank1]: a line", "[rank0]: train 999/1000", "[rank1]: cut off by a crash"]
    assert "\r" not in out.getvalue()


# -- the real thing --------------------------------------------------------------------------------------------------

def _rows_have_one_prefix(rows: list[str]) -> None:
    for row in rows:
        assert re.match(r"^\[rank[01]\]: ", row) and row.count("[rank") == 1, row


@pytest.fixture(scope="module")
def console_runs(tmp_path_factory):
    """The script's five runs, by name: the future of each (status, output); result() raises a run's failure
    (its deadline passed) in the test that reads it. Two at a time: every run sleeps 0.15 s a step and spends
    seconds on one core importing, so a second run fills the other core."""
    root = tmp_path_factory.mktemp("console")
    runs = {
        "launch tty": lambda: run_in_terminal([*LAUNCH, SCRIPT, "--output_dir", str(root / "launch-tty")]),
        "launch pipe": lambda: run_into_pipe([*LAUNCH, SCRIPT, "--output_dir", str(root / "launch-pipe"),
                                              "--disable_tqdm", "false"]),
        "launch crash": lambda: run_into_pipe([*LAUNCH, SCRIPT, "--output_dir", str(root / "crash"),
                                               "--crash_at_step", "4"]),
        "python tty": lambda: run_in_terminal([sys.executable, SCRIPT, "--output_dir", str(root / "tty")]),
        "python pipe": lambda: run_into_pipe([sys.executable, SCRIPT, "--output_dir", str(root / "pipe")]),
    }
    return two_at_a_time(runs)


def test_under_ddpkit_launch_in_a_terminal_the_bar_redraws_in_place(console_runs):
    rc, raw = console_runs["launch tty"].result()
    rows = screen(raw)
    print("\n".join(rows))
    assert rc == 0, raw
    _rows_have_one_prefix(rows)
    bars = [row for row in rows if "train:" in row]
    assert len(bars) == 1 and f"{STEPS}/{STEPS}" in bars[0] and bars[0].startswith("[rank0]: train: 100%"), rows
    assert raw.count("train:") > STEPS // 2, "the bar was not redrawn as it went"
    assert len(bars[0]) < COLUMNS  # one row: a status line that wrapped could not be redrawn in place
    # Rank 1's lines and the evaluations print above the bar, each whole on its own row.
    assert [row for row in rows if "took step" in row] == [f"[rank1]: rank 1 took step {s}" for s in
                                                           range(1, STEPS + 1)]
    evals = [row for row in rows if "eval " in row]
    assert len(evals) == EVALUATIONS and all(row.startswith("[rank0]: eval  step ") for row in evals)
    assert "eval_loss=" in evals[0] and "eval_accuracy=" in evals[0] and "epoch" in evals[0]
    assert rows.index(bars[0]) > max(rows.index(row) for row in evals)


def test_under_ddpkit_launch_into_a_pipe_the_bar_writes_a_line_per_log_and_a_traceback_one_prefix(console_runs):
    rc, out = console_runs["launch pipe"].result()
    assert rc == 0, out
    lines = out.splitlines()
    assert "\r" not in out
    bar = [line for line in lines if line.startswith("[rank0]: train ")]
    assert len(bar) == STEPS // LOGGING_STEPS, out  # one per logging step, never one per update
    assert bar[-1].startswith(f"[rank0]: train {STEPS}/{STEPS} [100%]")
    assert len([line for line in lines if "eval  step" in line]) == EVALUATIONS
    # A crash: torch prefixes the traceback's lines with the rank; the launcher adds none of its own to them.
    rc, out = console_runs["launch crash"].result()
    assert rc == 1, out
    assert "[rank1]: RuntimeError: rank 1 crashes on purpose at step 4" in out.splitlines(), out
    assert not [line for line in out.splitlines() if line.count("[rank") > 1], out


def test_plain_python_in_a_terminal_redraws_and_into_a_pipe_writes_a_line_per_log(console_runs):
    rc, raw = console_runs["python tty"].result()
    rows = screen(raw)
    assert rc == 0, raw
    bars = [row for row in rows if "train:" in row]
    assert len(bars) == 1 and bars[0].startswith("train: 100%") and f"{STEPS}/{STEPS}" in bars[0], rows
    assert raw.count("train:") > STEPS // 2
    assert len([row for row in rows if row.startswith("eval  step")]) == EVALUATIONS
    rc, out = console_runs["python pipe"].result()
    assert rc == 0, out
    assert len([line for line in out.splitlines() if line.startswith("train ")]) == STEPS // LOGGING_STEPS


def test_a_closed_pipe_ends_the_output_quietly():
    """`ddpkit launch ... | head`: each tail thread printed a BrokenPipeError traceback."""
    import io

    from ddpkit.launch.console import Console

    class Closed(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    console = Console(Closed(), terminal=False)
    console.feed(0, "one\n")
    console.feed(1, "two\nthree")  # nothing raised, nothing more written
    console.close()
