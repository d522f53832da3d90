"""ddpkit._utils.procfs: what /proc says of a process, and the cautious answers where it cannot say."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from ddpkit._utils import procfs

# A child that renames itself to a command name holding spaces and both parentheses (what a split on the first
# ")" would misread), says so, and sleeps until it is killed.
RENAMED = """
import ctypes, sys, time
ctypes.CDLL(None).prctl(15, b"a) b (c) d", 0, 0, 0)  # PR_SET_NAME
print("renamed", flush=True)
time.sleep(60)
"""


def _renamed_child() -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", RENAMED], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "renamed"
    return child


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux's /proc")
def test_stat_fields_of_a_name_with_parentheses_and_a_zombie_then_gone():
    child = _renamed_child()
    try:
        with open(f"/proc/{child.pid}/stat") as f:
            assert "a) b (c) d" in f.read()  # the name really holds them
        fields = procfs.stat_fields(child.pid)
        assert fields[0] in "RS" and fields[1] == str(os.getpid()), fields  # state, then the parent's pid
        assert fields[2] == str(os.getpgid(child.pid))  # the process group
        assert not procfs.process_ended(child.pid)
        child.kill()
        deadline = time.monotonic() + 10
        while procfs.stat_fields(child.pid)[0] != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert procfs.stat_fields(child.pid)[0] == "Z"
        assert procfs.process_ended(child.pid)  # a zombie nobody reaped yet has ended
    finally:
        child.kill()
        child.wait()
    assert procfs.stat_fields(child.pid) is None  # reaped: gone (its pid not reused this soon)
    assert procfs.process_ended(child.pid)


def test_without_proc_the_kernel_is_asked(monkeypatch):
    """No /proc (not Linux): whether the pid exists, by signal 0; a pid of another user's (EPERM) is alive."""
    monkeypatch.setattr(procfs, "stat_fields", lambda pid: None)
    monkeypatch.setattr(procfs.os.path, "isdir", lambda path: False)
    assert not procfs.process_ended(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: the pid exists no more
    assert procfs.process_ended(child.pid)

    def refused(pid, signal):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(procfs.os, "kill", refused)
    assert not procfs.process_ended(child.pid)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux's /proc")
def test_this_process_namespace_and_this_boot():
    assert re.fullmatch(r"pid:\[\d+\]", procfs.pid_namespace())
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", procfs.boot_id())
    assert procfs.boot_id() == procfs.boot_id()


def test_what_cannot_be_read_is_none(monkeypatch):
    assert procfs.stat_fields(-1) is None  # no such process

    def unreadable(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(procfs.os, "readlink", unreadable)
    monkeypatch.setattr("builtins.open", unreadable)
    assert procfs.pid_namespace() is None and procfs.boot_id() is None
    assert procfs.stat_fields(os.getpid()) is None


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux's /proc")
def test_descendants_are_children_and_theirs():
    grandparent = ("import subprocess, sys; "
                   "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
                   "print(c.pid, flush=True); c.wait()")
    child = subprocess.Popen([sys.executable, "-c", grandparent], stdout=subprocess.PIPE, text=True)
    grandchild = None
    try:
        grandchild = int(child.stdout.readline())
        assert procfs.descendants(child.pid) == [grandchild]
        assert {child.pid, grandchild} <= set(procfs.descendants(os.getpid()))
        assert procfs.descendants(-1) == []  # no such process
    finally:
        for pid in (grandchild, child.pid):
            if pid is not None:
                os.kill(pid, 9)
        child.wait(timeout=30)
