"""`ddpkit launch`'s report on a failed job (ddpkit.summary): which rank is the root cause, and what is shown."""

from __future__ import annotations

import os
import types

from ddpkit import summary


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
