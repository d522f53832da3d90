"""Stopped, crashed and resumed runs end bitwise where an uninterrupted run ends, through the real launcher.

Every run is `ddpkit launch --nproc-per-node 2 tests/scripts/train_resilient.py` (2 CPU workers, 24 steps of a
tiny MLP with dropout on synthetic data). The single truth is one uninterrupted run (module fixture); every
other run must end with the same parameter hash on both ranks. Each launch has a deadline, runs in its own
session and is reaped in a finally block; the workers die with their launcher (PR_SET_PDEATHSIG in the script).

The launcher's exit status after SIGTERM is 143 (128 + SIGTERM), even when every worker stopped cleanly,
checkpointed and exited 0. The job did not finish: 0 would let `ddpkit launch train.py && evaluate.sh` (or
a pipeline stage) carry on with a half-trained model, while 143 is what a shell, `timeout` and SLURM report
for a job ended by SIGTERM, so preemption wrappers that requeue on 143 (or on any non-zero status after
their own signal) work unchanged. Whether the workers stopped cleanly is in their output and in the
checkpoint, which is what the first test checks.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ddpkit._utils.procfs import descendants
from ddpkit.checkpoint.folders import checkpoint_step, list_checkpoints
from helpers.world import clean_env

SCRIPT = str(Path(__file__).parent.parent / "scripts" / "train_resilient.py")
LAUNCH = [sys.executable, "-m", "ddpkit", "launch", "--nproc-per-node", "2"]
MAX_STEPS = 24  # the script's default; every run here trains (or resumes) to it
DEADLINE_S = 90  # one launch; an uninterrupted one takes about 8 s on two busy cores
GRACE_S = 20  # --shutdown-timeout of the SIGTERM run (whole seconds, as torchrun takes it): far above the ~1 s a
# stop and a checkpoint take


class Launch:
    """A launcher in its own session; its merged output collected by a thread, so waiting has a deadline."""

    def __init__(self, argv: list[str]):
        self.argv = argv
        self.proc = subprocess.Popen(argv, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.eof = False
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self.eof = True
            self._changed.notify_all()

    @property
    def output(self) -> str:
        with self._changed:
            return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = DEADLINE_S) -> re.Match:
        """The first output line matching `pattern`; fails at the deadline or when the output ends first."""
        deadline, seen = time.monotonic() + timeout, 0
        with self._changed:
            while True:
                for line in self.lines[seen:]:
                    match = re.search(pattern, line)
                    if match:
                        return match
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if self.eof or left <= 0:
                    pytest.fail(f"no line matching {pattern!r} ({'output ended' if self.eof else 'deadline'})\n"
                                + "".join(self.lines))
                self._changed.wait(left)

    def finish(self, timeout: float = DEADLINE_S) -> int:
        """The exit status, within `timeout`; all output read."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{' '.join(self.argv)} passed its {timeout} s deadline\n{self.output}")
        self._reader.join(10)
        return self.proc.returncode

    def reap(self) -> None:
        """SIGTERM (which the launcher forwards to its workers), then SIGKILL to its session."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._reader.join(10)
        self.proc.stdout.close()


@contextlib.contextmanager
def launched(*launcher_args: str, out: Path, script_args: tuple[str, ...] = ()):
    job = Launch([*LAUNCH, "--log-dir", str(out / "logs"), *launcher_args, SCRIPT, "--output_dir", str(out),
                  *script_args])
    try:
        yield job
    finally:
        job.reap()


def run_to_end(*launcher_args: str, out: Path, script_args: tuple[str, ...] = ()) -> tuple[int, str]:
    with launched(*launcher_args, out=out, script_args=script_args) as job:
        return job.finish(), job.output


def results(output: str) -> dict[int, dict]:
    """Each rank's RESULT line (its last act before exiting 0), by rank; each rank must print exactly one."""
    found: dict[int, list[dict]] = {}
    for match in re.finditer(r"^\[rank(\d+)\]: RESULT (\{.*\})$", output, re.MULTILINE):
        found.setdefault(int(match.group(1)), []).append(json.loads(match.group(2)))
    assert sorted(found) == [0, 1] and all(len(v) == 1 for v in found.values()), output
    return {rank: lines[0] for rank, lines in found.items()}


def assert_same_end(output: str, reference_hash: str, resumed_at: int, restart: int = 0) -> None:
    for rank, res in results(output).items():
        assert (res["rank"], res["restart"], res["resumed_at"]) == (rank, restart, resumed_at), output
        assert (res["global_step"], res["stopped"]) == (MAX_STEPS, False), output
        assert res["params_sha256"] == reference_hash, f"rank {rank} ends elsewhere than the uninterrupted run"


@pytest.fixture(scope="module")
def reference_hash(tmp_path_factory):
    """The final parameters' hash of one uninterrupted run: the truth every interrupted run must reach. A
    function: the run starts here and goes on beside the first test's own launches (which import, then sleep
    0.5 s a step), and the hash is waited for when a test needs it; the run keeps its deadline and is reaped
    at the end of the module."""
    out = tmp_path_factory.mktemp("uninterrupted")
    began = time.monotonic()
    with launched(out=out) as job:

        @functools.cache
        def hash_of_the_end() -> str:
            rc = job.finish()
            print(f"uninterrupted run: {time.monotonic() - began:.1f} s")
            output = job.output
            assert rc == 0, output
            ends = results(output)
            assert ends[0]["params_sha256"] == ends[1]["params_sha256"], output  # the replicas agree
            assert ends[0]["global_step"] == MAX_STEPS and ends[0]["resumed_at"] == 0
            assert list_checkpoints(str(out)) == []  # save_strategy "no": the SIGTERM test counts checkpoints
            return ends[0]["params_sha256"]

        yield hash_of_the_end


@pytest.mark.parametrize("whom, persistent", [("launcher", "false"), ("job", "false"), ("job", "true")])
def test_sigterm_stops_every_rank_with_one_checkpoint_that_resumes_bitwise(tmp_path, reference_hash, whom, persistent):
    """The launcher alone is signalled, as Kubernetes signals a pod's first process, or every process of the job,
    as SLURM signals a job step's cgroup (the ranks' data loader workers too, also persistent ones, which live
    through the epochs)."""
    out = tmp_path / "run"
    # 0.5 s per step: the run would take 12 s, so the stop lands long before the end however late we read. Data
    # loader workers: the launcher's SIGTERM reaches each rank's process group, which they must not be in, and a
    # SIGTERM of their own must not end them (a worker killed by it made its rank's next batch raise, and no
    # checkpoint was written).
    with launched("--shutdown-timeout", str(GRACE_S), out=out,
                  script_args=("--sleep_per_step", "0.5", "--dataloader_num_workers", "2",
                               "--dataloader_persistent_workers", persistent)) as job:
        job.wait_for(r"^\[rank0\]: LOGGED step \d+$")
        sent = time.monotonic()
        for pid in [job.proc.pid, *(descendants(job.proc.pid) if whom == "job" else [])]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        rc = job.finish(GRACE_S + 30)
        stopped_in = time.monotonic() - sent
        output = job.output
    print(f"SIGTERM -> launcher exit: {stopped_in:.2f} s")

    assert rc == 128 + signal.SIGTERM, output  # see the module docstring
    assert "ddpkit launch: stopped by SIGTERM" in output
    assert stopped_in < GRACE_S, output  # within the grace period...
    assert "forcefully exiting" not in output, output  # ...and no worker needed torchelastic's SIGKILL
    # Every worker stopped on its own and exited 0: each printed its RESULT line, the last thing the script
    # does, and none left an error file (an uncaught exception writes one; see ddpkit.errors).
    ends = results(output)
    assert not list((out / "logs").glob("*.error.json")), output
    step = ends[0]["global_step"]
    assert 0 < step < MAX_STEPS, output
    for res in ends.values():
        assert (res["stopped"], res["global_step"], res["resumed_at"]) == (True, step, 0), output
    assert ends[0]["params_sha256"] == ends[1]["params_sha256"]
    # exactly one checkpoint, written at the step the ranks agreed to stop after
    assert [checkpoint_step(p) for p in list_checkpoints(str(out))] == [step]
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]

    rc, output = run_to_end(out=out, script_args=("--resume_from_checkpoint", "true"))
    assert rc == 0, output
    assert_same_end(output, reference_hash(), resumed_at=step)


def test_crashed_worker_is_restarted_and_resumes_from_the_newest_checkpoint_bitwise(tmp_path, reference_hash):
    out = tmp_path / "run"
    crash_at, save_steps, newest = 7, 3, 6  # checkpoints at steps 3 and 6 before the crash
    rc, output = run_to_end("--max-restarts", "1", out=out,
                            script_args=("--save_strategy", "steps", "--save_steps", str(save_steps),
                                         "--crash_at_step", str(crash_at)))
    assert rc == 0, output
    first_attempt = (out / "logs" / "rank1.log").read_text()
    assert f"CRASH rank 1 at step {crash_at}" in first_attempt
    assert f"RuntimeError: rank 1 crashes on purpose at step {crash_at}" in first_attempt
    assert "RESULT" not in (out / "logs" / "rank0.log").read_text()  # the first attempt ended nowhere
    for rank in (0, 1):
        assert "RESULT" in (out / "logs" / f"rank{rank}.restart1.log").read_text()
    # the restarted workers took only steps 7..24, from checkpoint-6, and ended where the reference did
    assert_same_end(output, reference_hash(), resumed_at=newest, restart=1)
