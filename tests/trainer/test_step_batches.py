"""The stop request of a window: Ctrl-C and SIGTERM under the real launcher, done from outside.

A terminal's Ctrl-C sends SIGINT to its whole foreground process group: the launcher and its workers. The tests
send it the same way (os.killpg on the launcher's session), so each worker gets it twice, from the terminal and
forwarded by the launcher, as it would in a real terminal. In one process (a notebook's Ctrl-C), a stop ends one
train() call only.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ddpkit.checkpoint.files import load_checkpoint
from ddpkit.checkpoint.folders import list_checkpoints
from ddpkit.trainer.callbacks import TrainerCallback
from ddpkit.trainer.step_batches import StopRequest
from ddpkit.trainer.trainer import Trainer
from helpers.models import Classifier, classification_data, trainer_args
from helpers.world import clean_env

HERE = Path(__file__).parent
SCRIPT = str(HERE.parent / "scripts" / "train_resilient.py")


class Job:
    """A launcher in its own session, its merged output read by a thread."""

    def __init__(self, *argv: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "ddpkit", "launch", "--nproc-per-node", "2", *argv],
                                     env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_until(self, done, deadline_s: float = 90) -> None:
        end = time.monotonic() + deadline_s
        while not done():
            assert self.proc.poll() is None and time.monotonic() < end, self.output
            time.sleep(0.05)

    def press_ctrl_c(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)

    def finish(self, deadline_s: float = 60) -> int:
        try:
            return self.proc.wait(deadline_s)
        finally:
            self.kill()

    def kill(self) -> None:
        """SIGKILL to its session, if it still runs (a test that failed before finish)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._reader.join(10)


@pytest.fixture(scope="module")
def ctrl_c_jobs(tmp_path_factory):
    """The two Ctrl-C tests' jobs, started together: each spends its first seconds importing on one core and
    then mostly sleeps (0.2 s and 5 s a step), so the second one's start costs the first almost nothing. Each
    test presses Ctrl-C on its own job; whatever still runs at the end is killed."""
    root = tmp_path_factory.mktemp("window")
    jobs = {
        "first": (root / "first", Job(SCRIPT, "--output_dir", str(root / "first"), "--max_steps", "400",
                                      "--sleep_per_step", "0.2")),
        # Each step sleeps 5 s first: a stop at the end of the step would wait for it; the second Ctrl-C must not.
        "second": (root / "second", Job(SCRIPT, "--output_dir", str(root / "second"), "--max_steps", "400",
                                        "--sleep_per_step", "5")),
    }
    try:
        yield jobs
    finally:
        for _, job in jobs.values():
            job.kill()


def test_the_first_ctrl_c_stops_every_rank_with_one_checkpoint(ctrl_c_jobs):
    out, job = ctrl_c_jobs["first"]
    job.wait_until(lambda: "LOGGED step" in job.output)
    job.press_ctrl_c()
    rc = job.finish()
    assert rc == 130, job.output  # the job did not finish: 128 + SIGINT, as a shell reports it
    assert job.output.count("Ctrl-C: every rank stops after this step") == 1, job.output
    results = re.findall(r'^\[rank\d\]: RESULT .*"stopped": true', job.output, re.MULTILINE)
    assert len(results) == 2, job.output  # both ranks stopped cleanly, neither was interrupted half-way
    found = list_checkpoints(str(out))
    assert len(found) == 1, found
    assert load_checkpoint(found[0]).trainer_state["should_stop"] is True


def test_a_second_ctrl_c_stops_at_once_without_a_checkpoint(ctrl_c_jobs):
    out, job = ctrl_c_jobs["second"]
    job.wait_until(lambda: "LOGGED step" in job.output)
    job.press_ctrl_c()
    time.sleep(1.5)  # past the 1 s in which a second SIGINT counts as the same Ctrl-C
    job.press_ctrl_c()
    job.finish()
    assert "KeyboardInterrupt" in job.output, job.output
    assert "RESULT" not in job.output and list_checkpoints(str(out)) == [], job.output


def test_an_example_stopped_by_sigterm_ends_cleanly_and_writes_no_final_model(tmp_path):
    out = tmp_path / "digits"
    job = Job(str(HERE.parent.parent / "examples" / "train_digits.py"), "--output_dir", str(out), "--disable_tqdm",
              "true", "--num_train_epochs", "400")
    job.wait_until(lambda: (out / "metrics.jsonl").exists())
    job.proc.send_signal(signal.SIGTERM)
    rc = job.finish()
    assert rc == 143, job.output
    assert "Traceback" not in job.output and "KeyError" not in job.output, job.output
    assert re.search(r"stopped at step \d+ of \d+; continue with --resume_from_checkpoint true", job.output)
    assert not (out / "model.safetensors").exists(), "a stopped run wrote a final model as if it had finished"
    assert len(list_checkpoints(str(out))) == 1


def test_a_reset_stop_request_forgets_the_stop_and_the_first_ctrl_c():
    stop = StopRequest(announce=False)
    with stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested
        stop.reset()
        assert not stop.requested
        time.sleep(stop.DUPLICATE_S + 0.1)
        os.kill(os.getpid(), signal.SIGINT)  # a first Ctrl-C again, not the second one (KeyboardInterrupt)
        assert stop.requested


def test_a_second_press_a_launcher_forwards_at_once_stops_a_worker_in_its_own_session(monkeypatch):
    """torchrun forwards a second Ctrl-C as SIGTERM at once: 0.3 s after the first it was taken for the same press
    (meant for a process in the terminal's group, which may get one press twice) and the worker trained on."""
    from ddpkit.trainer import step_batches as window

    stop = StopRequest(announce=False)
    monkeypatch.setattr(window.os, "getsid", lambda pid: os.getpid())  # a session leader, as torchelastic's workers
    with stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(window.os, "getsid", lambda pid: os.getpid() + 1)  # in a terminal's group: a duplicate
    with StopRequest(announce=False) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested


class CtrlCAtStep2(TrainerCallback):
    def __init__(self):
        self.pressed = False

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2 and not self.pressed:
            self.pressed = True
            os.kill(os.getpid(), signal.SIGINT)


def test_a_ctrl_c_ends_one_train_call_and_the_next_trains_on(tmp_path, local_world):
    """A notebook's pattern: Ctrl-C stops train() after the next step with a checkpoint; train() again trains.
    Before, the stop stayed asked: every later call ran one step and stopped (global_step 4, then 1)."""
    trainer = Trainer(Classifier().double(), trainer_args(tmp_path, max_steps=8, per_device_train_batch_size=4),
                      train_dataset=classification_data(20), callbacks=[CtrlCAtStep2()])
    first = trainer.train()
    assert first.global_step == 3 and first.metrics["stopped"] == 1.0
    resumed = trainer.train(resume_from_checkpoint=True)
    assert resumed.global_step == 8 and "stopped" not in resumed.metrics
    again = trainer.train()
    assert again.global_step == 8 and "stopped" not in again.metrics
