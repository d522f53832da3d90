"""`ddpkit launch`'s report on a failed job (ddpkit.launch.failure_report): which rank is the root cause, and what is shown."""

from __future__ import annotations

import os
import re
import types

import pytest

from ddpkit.launch import failure_report as summary
from helpers.world import two_at_a_time


def test_root_cause_is_the_traceback_not_the_ranks_stopped_after_it(tmp_path):
    def failure(rank, exitcode, trace=None, when=0):
        data = {"message": {"message": "E", "extraInfo": {"py_callstack": trace, "timestamp": "5"}}} if trace else {}
        error_file = tmp_path / f"{rank}.json"
        if trace:
            error_file.write_text("{}")
            os.utime(error_file, ns=(when, when))
        return types.SimpleNamespace(local_rank=rank, pid=100 + rank, exitcode=exitcode, timestamp=5,
                                     error_file=str(error_file), error_file_data=data)

    # rank 0 raised only because rank 2 died first (a later file); rank 1 was stopped by the agent
    failures = {0: failure(0, 1, "Peer failed", when=2_000), 1: failure(1, -15),
                2: failure(2, 1, "ValueError: x", when=1_000)}
    assert summary.root_cause(failures) == 2
    text = summary.failure_summary(failures)
    assert "root cause: rank 2" in text and "ValueError: x" in text and "rank 1 killed by SIGTERM" in text
    # no traceback anywhere: the worker that died on its own beats the ones the agent stopped
    out = tmp_path / "rank1.log"
    out.write_text("".join(f"line {i}\n" for i in range(50)))
    # (in the order the agent saw them: the one that died first, then those it stopped)
    failures = {2: failure(2, -11), 0: failure(0, -15), 1: failure(1, -9)}
    assert summary.root_cause(failures) == 2
    text = summary.failure_summary({1: failure(1, 3), 0: failure(0, -15)}, {1: str(out)})
    assert "root cause: rank 1" in text and "exited with code 3" in text and "line 49" in text
    assert "line 29" not in text  # only the tail
    # torchelastic's "<NONE>" for a worker without an error file is no traceback: its output tail is shown,
    # and a peer that raised only because that worker vanished is not blamed
    killed = failure(0, -9)
    killed.error_file, killed.error_file_data = str(tmp_path / "missing.json"), {"message": "<NONE>"}
    consequence = failure(1, -15, "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:1", when=500)
    assert summary.root_cause({0: killed, 1: consequence}) == 0
    text = summary.failure_summary({0: killed, 1: consequence}, {0: str(out)})
    assert "root cause: rank 0" in text and "<NONE>" not in text and "line 49" in text
    # The failures in the order the agent saw them: the first one seen died on its own, whatever the signal and
    # the whole-second timestamps (the OOM killer's SIGKILL, a SIGTERM from outside), the ranks it stopped after.
    assert summary.root_cause({6: failure(6, -9), 5: failure(5, -15)}) == 6
    # ... but not always in that order: every rank exiting with a bad argument's code 2, one listed first as
    # stopped by the agent's SIGTERM (2 of 56 launches in a review), the exit code is the cause
    assert summary.root_cause({8: failure(8, -15), 9: failure(9, 2)}) == 9
    # a rank whose own SIGTERM handler exits with 128 + 15 was stopped by the agent as much as one the signal ended
    assert summary.root_cause({9: failure(9, -9), 8: failure(8, 143)}) == 9
    peer_words = failure(7, 1, "RuntimeError: [gloo] Connection closed by peer", when=900)
    assert summary.root_cause({5: failure(5, -15), 7: peer_words}) == 5
    # A rank's own error in a peer's words beats the ranks stopped after it, by SIGTERM or (ignored) SIGKILL.
    reset = failure(0, 1, "ConnectionResetError: Connection reset by peer (downloading a shard)", when=500)
    assert summary.root_cause({0: reset, 1: failure(1, -15)}) == 0
    assert summary.root_cause({0: reset, 6: failure(6, -9)}) == 0


def test_the_launcher_takes_an_explanation_for_the_root_cause_though_it_quotes_a_closed_connection(tmp_path):
    def failure(rank, trace, when):
        path = tmp_path / f"{rank}.json"
        path.write_text("{}")
        os.utime(path, ns=(when, when))
        data = {"message": {"message": "E", "extraInfo": {"py_callstack": trace, "timestamp": "5"}}}
        return types.SimpleNamespace(local_rank=rank, pid=rank, exitcode=1, timestamp=5, error_file=str(path),
                                     error_file_data=data)

    quoted = "ddpkit.errors.PeerLeftError: rank 2 left the job early ...\n(the collective failed with: " \
             "Connection reset by peer)"
    failures = {0: failure(0, "RuntimeError: Connection reset by peer", 1_000), 1: failure(1, quoted, 2_000)}
    assert summary.root_cause(failures) == 1
    failures[1] = failure(1, "RuntimeError: Connection reset by peer", 2_000)  # no explanation: the earliest
    assert summary.root_cause(failures) == 0


def test_the_output_tail_counts_a_redrawn_progress_bar_as_one_line(tmp_path):
    """Each carriage-return redraw was a line of its own: 20 of them pushed out the line before the crash."""
    out = tmp_path / "rank0.log"
    bar = "".join(f"\rtraining {p}%" for p in range(0, 101, 5))
    out.write_text("important: about to allocate\n" + bar + "\n" + "Traceback: boom\n", newline="")
    tail = summary._tail(str(out), lines=3)
    assert tail == "important: about to allocate\ntraining 100%\nTraceback: boom\n", tail


def _failure(tmp_path, rank, exitcode, trace=None, when=0):
    """A failure as torchelastic reports it (a rank that exited 0 as the launcher adds it), with a traceback
    written `when` (ns) if any."""
    error_file = tmp_path / f"{rank}.json"
    if trace:
        error_file.write_text("{}")
        os.utime(error_file, ns=(when, when))
    data = {"message": {"message": "E", "extraInfo": {"py_callstack": trace, "timestamp": "5"}}} if trace else {}
    return types.SimpleNamespace(local_rank=rank, pid=100 + rank, exitcode=exitcode, timestamp=5,
                                 error_file=str(error_file), error_file_data=data)


def test_a_rank_that_exited_0_while_the_others_ran_is_the_root_cause(tmp_path):
    """It left no failure for torchelastic, so the summary blamed the peer that lost it, in gloo's words."""
    left = _failure(tmp_path, 1, 0)
    lost = _failure(tmp_path, 0, 1, "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:1", when=500)
    out = tmp_path / "rank1.log"
    out.write_text("LEAVING 1\n")
    assert summary.root_cause({1: left, 0: lost}) == 1
    text = summary.failure_summary({1: left, 0: lost}, {1: str(out)})
    assert ("root cause: rank 1 (local rank 1, pid 101) exited with code 0 before the job finished (while the other "
            "ranks still needed it: a sys.exit(0), os._exit(0) or return") in text, text
    assert "LEAVING 1" in text and "what rank 0 saw, which exited with code 1:\nRuntimeError: [gloo]" in text, text
    assert "then: rank 0 exited with code 1" in text
    # A rank that died on its own comes first: the one that exited 0 may simply have finished before a peer
    # crashed at its teardown (a review's launch blamed rank 0, done, for rank 1's SIGSEGV, SIGKILL or exit 3)
    for died in (-11, -6, -9, 3):
        assert summary.root_cause({1: left, 0: _failure(tmp_path, 0, died)}) == 0
    # A rank's own error, or ddpkit's account naming the rank that left, is the root cause still
    assert summary.root_cause({1: left, 0: _failure(tmp_path, 0, 1, "ValueError: bad batch", when=600)}) == 0
    explained = _failure(tmp_path, 0, 1, "PeerLeftError: rank 1 left the job early (Connection reset by peer)", 700)
    assert summary.root_cause({1: left, 0: explained}) == 0
    text = summary.failure_summary({1: left, 0: explained})
    assert "root cause: rank 0" in text and "then: rank 1 exited with code 0 before the job finished" in text
    # before the ranks the agent stopped after the failure it saw first, whatever their order
    assert summary.root_cause({0: lost, 5: _failure(tmp_path, 5, -15), 1: left, 6: _failure(tmp_path, 6, -9)}) == 1


def test_a_launch_whose_rank_os_exits_0_mid_training_names_that_rank():
    """Rank 1 calls os._exit(0) at step 3 of a plain ddpkit DDP loop; rank 0 fails in gloo's words."""
    from helpers.world import LAUNCH, run

    script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "exit_zero.py")
    result = run([*LAUNCH, "--nproc-per-node", "2", script, "--how", "os_exit", "--at-step", "3"])
    assert result.rc == 1, result.err
    text = result.err[result.err.index("ddpkit launch: the job failed"):]
    assert "root cause: rank 1 (local rank 1, pid " in text, text
    assert ") exited with code 0 before the job finished (while the other ranks still needed it" in text, text
    assert "the last lines of its output:\nLEAVING 1 " in text and "what rank 0 saw, which exited with code 1" in text
    assert "then: rank 0 exited with code 1" in text


# ---------------------------------------------------------------------------------------------------------
# From outside: the launcher's summary
# ---------------------------------------------------------------------------------------------------------

MISBEHAVE = str(os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "misbehave.py"))


@pytest.fixture(scope="module")
def misbehaved(tmp_path_factory):
    """Both launches of misbehave.py, side by side (each keeps its deadline): by mode, its finished future."""
    from helpers.world import LAUNCH, run

    def launch(mode, *extra):
        out = tmp_path_factory.mktemp(mode)
        return lambda: run([*LAUNCH, "--nproc-per-node", "2", MISBEHAVE, "--mode", mode, *extra, "--output_dir",
                            str(out)], timeout=150)

    return two_at_a_time({"eval_on_rank0": launch("eval_on_rank0"),
                          "leave_early": launch("leave_early", "--leave_at_step", "3"),
                          "vanish": launch("vanish", "--leave_at_step", "3")})


def test_trainer_evaluate_on_rank0_only_ends_the_job_within_seconds(misbehaved):
    result = misbehaved["eval_on_rank0"].result()
    entered = max(float(t) for t in re.findall(r"ENTER \d ([\d.]+)", result.out))
    print(f"last rank entered the mismatched collective -> launcher exited: {result.ended - entered:.2f} s")
    assert result.rc == 1, result.err
    assert "FINISHED" not in result.out
    summary = result.err[result.err.index("ddpkit launch: the job failed"):]
    assert "DeadlockError" in summary and "ORDER MISMATCH" in summary, summary
    assert ("rank 0 called all_reduce (eval loss) where rank 1 called all_gather_object (evaluation predictions)"
            in summary), summary
    assert "trainer.evaluate()" in summary and "trainer.predict(data)" in summary, summary  # and from where
    # ddp_timeout is 1800 s and the stall threshold 60 s: only the certain-deadlock path ends it this soon
    assert result.ended - entered < 30, result.ended - entered


def test_a_rank_that_exits_0_mid_training_is_named_as_the_root_cause(misbehaved):
    result = misbehaved["leave_early"].result()
    left = float(re.search(r"LEAVING 1 ([\d.]+)", result.out).group(1))
    print(f"rank 1 left -> launcher exited: {result.ended - left:.2f} s")
    assert result.rc == 1, result.err
    summary = result.err[result.err.index("ddpkit launch: the job failed"):]
    assert ("PeerLeftError: rank 1 left the job early (its process exited without raising: the end of its script, "
            "or sys.exit) after collective #") in summary, summary
    assert "the root cause" in summary and "Connection reset" not in summary.split("PeerLeftError")[1][:300]
    assert "backward 3" in summary, summary  # rank 0 waited in the bucket of the step rank 1 never took
    assert result.ended - left < 30, result.ended - left


def test_a_rank_that_os_exits_0_mid_training_is_named_as_the_root_cause(misbehaved):
    result = misbehaved["vanish"].result()
    assert result.rc == 1, result.err
    summary = result.err[result.err.index("ddpkit launch: the job failed"):]
    assert "PeerVanishedError: rank 1 (pid " in summary and "ended without telling the others" in summary, summary
    assert "os._exit" in summary and ": the root cause. Rank 0 was in collective #" in summary, summary
