"""Workers stop when their launcher dies: kill -9 of `ddpkit launch`, done from outside."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from ddpkit.checkpoint.files import load_checkpoint
from ddpkit.checkpoint.folders import list_checkpoints
from helpers.world import clean_env, reap

SCRIPT = str(Path(__file__).parent.parent / "scripts" / "train_resilient.py")


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], deadline_s: float) -> float:
    began = time.monotonic()
    while any(_alive(p) for p in pids):
        assert time.monotonic() - began < deadline_s, f"workers {[p for p in pids if _alive(p)]} outlived it"
        time.sleep(0.1)
    return time.monotonic() - began


def _kill_the_launcher_while_training(argv: list[str], workers_of) -> tuple[str, float]:
    """Start `argv` (a launcher of SCRIPT), SIGKILL it once a step is logged, and wait for its workers
    (`workers_of(launcher pid)`) to end by themselves; (its output, how long they took). KEEP_ORPHANS=1: the
    script's own test hygiene (PR_SET_PDEATHSIG) is off, so only ddpkit can stop them."""
    launcher = subprocess.Popen(argv, env=clean_env(KEEP_ORPHANS="1"), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(launcher.stdout), daemon=True).start()
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while not any("LOGGED step" in line for line in lines):
            assert launcher.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        workers = workers_of(launcher.pid)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(10)
        took = _wait_gone(workers, deadline_s=20)
    finally:
        for pid in [launcher.pid, *workers]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        launcher.wait()
    return "".join(lines), took


def _two_workers(launcher: int) -> list[int]:
    workers = _children(launcher)
    assert len(workers) == 2, workers
    return workers


def test_workers_stop_with_a_checkpoint_when_the_launcher_is_killed(tmp_path):
    out = tmp_path / "run"
    _, took = _kill_the_launcher_while_training(
        [sys.executable, "-m", "ddpkit", "launch", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"),
         SCRIPT, "--output_dir", str(out), "--max_steps", "400", "--sleep_per_step", "0.2"], _two_workers)
    print(f"workers stopped {took:.1f} s after the launcher's SIGKILL")
    logs = "".join(p.read_text() for p in sorted((tmp_path / "logs").glob("rank*.log")))
    assert "the launcher" in logs and "is gone" in logs, logs
    found = list_checkpoints(str(out))
    assert len(found) == 1, (found, logs)  # the Trainer's agreed stop: one checkpoint, whole
    state = load_checkpoint(found[0]).trainer_state
    assert 0 < state["global_step"] < 400 and state["should_stop"] is True


WATCHED = textwrap.dedent("""
    import signal, sys, time
    from ddpkit.distributed.launcher_watch import watch_parent
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a worker that ignores the stop: the grace period ends it
    watch_parent(grace_s=1.0, poll_s=0.1)
    print("watching", flush=True)
    time.sleep(60)
    sys.exit(7)
""")


def test_a_worker_that_ignores_the_stop_is_ended_after_the_grace_period(tmp_path):
    script = tmp_path / "watched.py"
    script.write_text(WATCHED)
    pidfile = tmp_path / "pid"
    # An intermediate shell is the watched process's parent; killing it orphans the watched one.
    parent = subprocess.Popen(["/bin/sh", "-c", f'"{sys.executable}" "{script}" & echo $! > "{pidfile}"; wait'],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert parent.stdout.readline().strip() == "watching"
        child = int(pidfile.read_text())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(5)
        took = _wait_gone([child], deadline_s=15)
    finally:
        try:
            os.killpg(parent.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        parent.wait()
    said = parent.stderr.read()  # the orphan inherited the pipe: its last words are here
    assert "is gone: stopping this worker" in said and "did not stop within 1 s" in said, said
    assert took >= 0.8, f"ended {took:.2f} s after its parent: before the grace period was over"


def test_a_launcher_that_is_pid_1_is_not_taken_for_gone(monkeypatch):
    """A container whose entrypoint is the launcher: every worker's parent is pid 1 from the start, which the
    watch took for a launcher already gone, so every worker stopped itself at init_process_group."""
    from ddpkit.distributed import launcher_watch as orphan

    calls = []
    monkeypatch.setattr(orphan.os, "kill", lambda pid, sig: calls.append(sig))
    monkeypatch.setattr(orphan.os, "_exit", lambda code: calls.append(("exit", code)))
    monkeypatch.setattr(orphan.time, "sleep", lambda seconds: None)
    orphan._watch(1, grace_s=0.0, poll_s=0.0)
    assert calls == []


SUBREAPER = str(Path(__file__).parent.parent / "scripts" / "subreaper.py")
SLOW_START = str(Path(__file__).parent.parent / "scripts" / "slow_start.py")


def test_workers_stop_when_the_launcher_dies_before_their_watch_begins(tmp_path):
    """The launcher SIGKILLed while its workers start, under a subreaper: rank 0 is in init_process_group (its
    watch began with the launcher as its parent), rank 1 not there yet. Rank 1 was re-parented to the subreaper
    (elsewhere to pid 1), and the watch that began afterwards took that for its launcher (pid 1: watched
    nothing), so rank 1 went on into the rendezvous with the launcher's store gone and hung there."""
    go, logs = tmp_path / "go", tmp_path / "logs"
    reaper = subprocess.Popen([sys.executable, SUBREAPER, sys.executable, "-m", "ddpkit", "launch", "--nproc-per-node",
                               "2", "--log-dir", str(logs), SLOW_START, "--go", str(go)],
                              env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(reaper.stdout), daemon=True).start()
    workers: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 90
        while "JOINING 0" not in "".join(lines) or len(workers) < 2:
            assert reaper.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
            workers = {int(r): int(p) for r, p in re.findall(r"STARTED (\d) (\d+)", "".join(lines))}
        time.sleep(1.0)  # rank 0 is inside init_process_group, its watch begun; rank 1 waits for the go
        launcher = int(re.search(r"CHILD (\d+)", "".join(lines)).group(1))
        os.kill(launcher, signal.SIGKILL)
        while f"REAPED {launcher} " not in "".join(lines):  # the subreaper took the orphans
            assert time.monotonic() < deadline + 10, "".join(lines)
            time.sleep(0.05)
        go.touch()  # rank 1 goes on to init_process_group, whose watch begins now
        took = _wait_gone(list(workers.values()), deadline_s=30)
        print(f"workers stopped {took:.1f} s after the launcher's SIGKILL")
    finally:
        for pid in workers.values():  # in sessions of their own: the reaper's group does not hold them
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        reap(reaper)
    said = {rank: (logs / f"rank{rank}.log").read_text() for rank in (0, 1)}
    # (rank 0, in the rendezvous, may learn it first from the launcher's store, which went with it)
    assert f"[ddpkit] the launcher (pid {launcher}) is gone: stopping this worker (pid {workers[1]}); its parent " \
           f"is now pid {reaper.pid}" in said[1], said[1]
    assert "TRAINING" not in said[0] + said[1]


def test_a_worker_re_parented_to_pid_1_knows_its_launcher_is_gone(monkeypatch):
    """Without a subreaper the orphan's parent is pid 1, which the watch could not tell from a launcher that is
    its container's init; ddpkit launch's pid tells them apart."""
    from ddpkit.distributed import launcher_watch as orphan

    calls = []
    monkeypatch.setattr(orphan.os, "getppid", lambda: 1)
    monkeypatch.setattr(orphan.os, "kill", lambda pid, sig: calls.append(sig))
    monkeypatch.setattr(orphan.os, "_exit", lambda code: calls.append(("exit", code)))
    monkeypatch.setattr(orphan.time, "sleep", lambda seconds: None)
    orphan._watch(1, grace_s=0.0, poll_s=0.0, launcher=4242)
    assert calls == [signal.SIGTERM, ("exit", 1)]
    calls.clear()
    orphan._watch(1, grace_s=0.0, poll_s=0.0, launcher=1)  # the launcher is init: nothing to watch
    assert calls == []


def test_a_launcher_above_a_wrapper_is_watched_through_it():
    """`ddpkit launch --no-python sh -c "python train.py"`: the worker's parent is the shell, and the launcher its
    grandparent, which runs as long as it is an ancestor."""
    from ddpkit.distributed import launcher_watch as orphan

    parent = os.getppid()
    grandparent = orphan._parent_of(parent)
    assert orphan.descends_from(parent) and orphan.descends_from(grandparent)
    assert orphan.launcher_runs(parent, grandparent)() and orphan.launcher_runs(parent, parent)()
    ended = subprocess.Popen(["true"])
    ended.wait()
    assert not orphan.descends_from(ended.pid) and not orphan.launcher_runs(parent, ended.pid)()
    assert orphan.launcher_runs(1, None) is None and orphan.launcher_runs(1, 1) is None


def test_workers_under_torchrun_through_a_wrapper_stop_when_it_is_killed(tmp_path):
    """`torchrun --no-python sh -c "python train.py ...; echo done"`: the worker's parent is the shell, which
    outlives torchrun's SIGKILL, so the watch of the parent never fired and the worker trained on. torchelastic
    makes the shell lead a session of its own: the launcher is the session leader's parent."""
    out = tmp_path / "run"
    command = f"{sys.executable} {SCRIPT} --output_dir {out} --max_steps 400 --sleep_per_step 0.2; echo done"

    def worker_under_the_shell(launcher: int) -> list[int]:
        (shell,) = _children(launcher)
        workers = _children(shell)
        assert len(workers) == 1, workers
        return workers

    lines, took = _kill_the_launcher_while_training(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--no-python", "sh", "-c", command],
        worker_under_the_shell)
    print(f"the worker stopped {took:.1f} s after torchrun's SIGKILL")
    found = list_checkpoints(str(out))
    assert len(found) == 1, (found, lines)  # the Trainer's agreed stop: one checkpoint


def test_only_a_session_leader_the_launch_started_is_taken_for_a_wrapper():
    """The launcher is the session leader's parent only where the launch started that leader (it carries the
    worker's TORCHELASTIC_RUN_ID): a worker sharing its launcher's session (a function entrypoint's, a notebook's)
    would otherwise have watched the login shell's parent and stopped when the user logged out."""
    from ddpkit.distributed.launcher_watch import session_launcher

    probe = f"{sys.executable} -c 'from ddpkit.distributed.launcher_watch import session_launcher; print(session_launcher(\"x\"))'"
    env = clean_env(TORCHELASTIC_RUN_ID="x")
    wrapped = subprocess.run(["sh", "-c", f"{probe}; true"], env=env, capture_output=True, text=True,
                             start_new_session=True, timeout=60)
    assert wrapped.stdout.strip() == str(os.getpid()), wrapped  # the wrapper's parent: here, this process
    shared = subprocess.run(["sh", "-c", f"{probe}; true"], env=env, capture_output=True, text=True, timeout=60)
    assert shared.stdout.strip() == "None", shared  # the leader of this test's session is no wrapper of the launch
    assert session_launcher(None) is None
