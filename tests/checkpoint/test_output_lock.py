"""One run at a time in an output_dir: the lock alone, and two real runs into one folder."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ddpkit.checkpoint.files import load_checkpoint
from ddpkit.checkpoint.folders import list_checkpoints
from ddpkit.checkpoint.output_lock import LOCK_FILE, OutputDirLock
from ddpkit.errors import OutputDirBusy
from helpers.world import clean_env

SCRIPT = str(Path(__file__).parent.parent / "scripts" / "train_resilient.py")


def _write_owner(folder: Path, **owner) -> None:
    (folder / LOCK_FILE).write_text(json.dumps(owner))


def test_a_live_owner_is_refused_a_dead_one_taken_over(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        theirs = OutputDirLock(str(tmp_path))
        theirs.me = {"host": socket.gethostname(), "pid": sleeper.pid,
                     "start_time": open(f"/proc/{sleeper.pid}/stat").read().rsplit(")", 1)[1].split()[19]}
        theirs.acquire()  # as if the other process had taken it
        with pytest.raises(OutputDirBusy, match=rf"in use by another run \(pid {sleeper.pid} on "):
            OutputDirLock(str(tmp_path)).acquire()
    finally:
        sleeper.kill()
        sleeper.wait()
    mine = OutputDirLock(str(tmp_path))
    mine.acquire()  # its owner is dead now: stale, taken over
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert (tmp_path / ".ddpkit.lock").exists()  # the name the docs give and earlier runs left behind
    mine.acquire()  # the same process again (a second train() call): still its own
    mine.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_recycled_pid_an_empty_file_and_another_host(tmp_path):
    # Our own pid, but another process start time: the pid was recycled, the owner is gone.
    _write_owner(tmp_path, host=socket.gethostname(), pid=os.getpid(), start_time="1")
    with OutputDirLock(str(tmp_path)):
        pass
    # A lock written by another machine cannot be judged from here.
    _write_owner(tmp_path, host="elsewhere-node-7", pid=1, start_time="1", since="yesterday")
    with pytest.raises(OutputDirBusy, match=f"elsewhere-node-7.*delete {re.escape(str(tmp_path / LOCK_FILE))}"):
        OutputDirLock(str(tmp_path)).acquire()
    # An empty lock file (its writer killed before the first byte) is stale once it is old.
    (tmp_path / LOCK_FILE).write_text("")
    os.utime(tmp_path / LOCK_FILE, (time.time() - 60, time.time() - 60))
    with OutputDirLock(str(tmp_path)):
        pass


def test_another_pid_namespace_is_not_judged_and_an_earlier_boot_is_gone(tmp_path):
    """A container with this host name (host networking) records its own pid 1: on the host, pid 1 is another
    process, and the lock was taken from a live run (launch review). Written before the last boot: stale."""
    mine = OutputDirLock(str(tmp_path)).me
    if mine["pid_ns"] is None or mine["boot"] is None:
        pytest.skip("no /proc here to read the PID namespace and the boot id")
    owner = {**mine, "pid": 1, "start_time": "1", "pid_ns": "pid:[1]", "since": "now"}
    _write_owner(tmp_path, **owner)
    with pytest.raises(OutputDirBusy, match=r"pid 1 on .*, in another PID namespace \(a container\)\): if that run "
                                            "is gone, delete"):
        OutputDirLock(str(tmp_path)).acquire()
    _write_owner(tmp_path, **{**owner, "boot": "an-earlier-boot"})
    with OutputDirLock(str(tmp_path)):
        pass
    # Still being written (empty, young): not "pid None on None".
    (tmp_path / LOCK_FILE).write_text("")
    with pytest.raises(OutputDirBusy, match="being claimed by another run"):
        OutputDirLock(str(tmp_path)).acquire()


def test_a_second_run_into_the_same_output_dir_is_refused(tmp_path):
    out = tmp_path / "run"
    # A long first run, stopped with SIGTERM once the second one has been turned away.
    first = subprocess.Popen([sys.executable, "-m", "ddpkit", "launch", "--nproc-per-node", "2", SCRIPT,
                              "--output_dir", str(out), "--max_steps", "400", "--sleep_per_step", "0.2",
                              "--save_strategy", "steps", "--save_steps", "2"],
                             env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(first.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 90
        while not any("LOGGED step" in line for line in lines):
            assert first.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        second = subprocess.run([sys.executable, "-m", "ddpkit", "launch", "--nproc-per-node", "1", SCRIPT,
                                 "--output_dir", str(out), "--max_steps", "4"], env=clean_env(),
                                capture_output=True, text=True, timeout=90)
        assert first.poll() is None, "".join(lines)
        first.send_signal(15)
        first.wait(60)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, 9)
            first.wait()
    reader.join(10)
    said = second.stdout + second.stderr
    assert second.returncode != 0 and "is in use by another run" in said and str(out) in said, said
    # The first run never noticed: its metrics are its own, every checkpoint it left loads.
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 1, steps
    found = list_checkpoints(str(out))
    assert found and load_checkpoint(found[-1]).trainer_state["should_stop"] is True
    for path in found:
        load_checkpoint(path)
    assert not (out / LOCK_FILE).exists(), "the lock outlived its run"
