"""A rank that fails or leaves takes the job down at once, named: what the ranks tell each other through the
board in the job's store (ddpkit.doctor.rank_states: a failure, a departure) and what a rank blocked in a collective makes
of a peer gone with its store or frozen with it (ddpkit.doctor.inspector's explanation)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import torch

from helpers.world import run_pair, run_world

TIMEOUT_S = 8  # the collective timeout (ddp_timeout) of these worlds
STALL_S = 2  # the inspector's threshold


CRASHING_SCRIPT = textwrap.dedent("""
    import time, torch, ddpkit
    world = ddpkit.init_process_group(backend="gloo", timeout=300, stall_seconds=60)
    ddpkit.Comm.for_group().all_reduce(torch.ones(1), "hello")
    if world.rank == 1:
        raise ValueError("rank one blew up in its step")
    start = time.monotonic()
    try:
        while True:  # rank 0 computes, never reaching a collective that could fail
            sum(range(10000))
    except ddpkit.PeerFailedError as exc:
        print(f"stopped after {time.monotonic() - start:.1f} s: {exc}", flush=True)
        raise SystemExit(3)
""")


CRASHING_IN_A_COLLECTIVE = CRASHING_SCRIPT.replace(
    "    while True:  # rank 0 computes, never reaching a collective that could fail\n"
    "        sum(range(10000))\n",
    "    ddpkit.Comm.for_group().all_reduce(torch.ones(1), 'waiting for rank 1')\n")
assert CRASHING_IN_A_COLLECTIVE != CRASHING_SCRIPT


# The same failure, reported past our excepthook: in a `finally:` that destroys the group (torch's docs' pattern),
# and under an excepthook of the script's own (rich.traceback.install() replaces it so).
FAILING_IN_FINALLY = CRASHING_IN_A_COLLECTIVE.replace(
    '    raise ValueError("rank one blew up in its step")\n',
    '    try:\n        raise ValueError("rank one blew up in its step")\n'
    '    finally:\n        ddpkit.destroy_process_group()\n').replace(
    "except ddpkit.PeerFailedError as exc:", "except (ddpkit.PeerFailedError, ddpkit.PeerLeftError) as exc:")
FAILING_UNDER_OWN_HOOK = CRASHING_IN_A_COLLECTIVE.replace(
    '    raise ValueError("rank one blew up in its step")\n',
    '    import sys\n    sys.excepthook = lambda *exc: print("the script\'s own hook", file=sys.stderr)\n'
    '    raise ValueError("rank one blew up in its step")\n')
assert FAILING_IN_FINALLY != CRASHING_IN_A_COLLECTIVE != FAILING_UNDER_OWN_HOOK


STORE_HOST_LEAVES = textwrap.dedent("""
    import os, torch, ddpkit
    world = ddpkit.init_process_group(backend="gloo", timeout=60, stall_seconds=30)
    ddpkit.Comm.for_group().all_reduce(torch.ones(1), "hello")
    if world.rank == 0:
        os._exit(0)  # gone with the store it hosts, without posting anything there (as a kill would be)
    else:  # rank 1 takes one more step
        try:
            ddpkit.Comm.for_group().all_reduce(torch.ones(1), "a step rank 0 never takes")
        except (ddpkit.PeerLeftError, ddpkit.PeerVanishedError) as exc:
            print(f"{type(exc).__name__}: {exc}", flush=True)
            raise SystemExit(3)
""")


HANDLED_IN_FINALLY = textwrap.dedent("""
    import time, torch, ddpkit
    class Finished(Exception):
        pass
    world = ddpkit.init_process_group(backend="gloo", timeout=60, stall_seconds=30)
    try:
        try:
            ddpkit.Comm.for_group().all_reduce(torch.ones(1), "hello")
            if world.rank == 1:
                raise Finished("an early stop, caught below")
            time.sleep(3)  # rank 0 still busy (writing its results), its inspector polling
        finally:
            ddpkit.destroy_process_group()
    except Finished:
        pass
    print("clean", flush=True)
""")


def _two_ranks(script_text, tmp_path):
    """Run a script as ranks 0 and 1 of a gloo job; their return codes and (stdout, stderr)."""
    ranks = run_pair(tmp_path, script_text)
    return [code for code, _, _, _ in ranks], [(out, err) for _, out, err, _ in ranks]


def test_a_crashed_rank_stops_the_others_quickly(tmp_path):
    codes, ((out0, err0), (out1, err1)) = _two_ranks(CRASHING_SCRIPT, tmp_path)
    assert codes[1] != 0 and "rank one blew up" in err1
    assert codes[0] == 3, (out0, err0)
    stopped = float(out0.split("stopped after ")[1].split(" s")[0])
    assert stopped < 10, f"rank 0 took {stopped} s to stop"
    assert "rank 1 failed" in err0 and "rank one blew up" in err0, err0
    # Waiting in a collective when rank 1 dies, rank 0 raises what broke it, not gloo's "Connection closed by peer"
    codes, ((out0, err0), _) = _two_ranks(CRASHING_IN_A_COLLECTIVE, tmp_path)
    assert codes[0] == 3, (out0, err0)
    assert ("rank 1 failed with ValueError: rank one blew up in its step, so rank 0 stops. Rank 0 was in collective "
            "#2 all_reduce (waiting for rank 1)") in out0, (out0, err0)
    # Not "rank 1 left the job early (it called destroy_process_group)" nor "(its process exited without an error)".
    # In the `finally:` it may yet catch the exception: it left, naming it (a handled one must not end the others).
    codes, ((out0, err0), _) = _two_ranks(FAILING_IN_FINALLY, tmp_path)
    assert codes[0] == 3 and ("rank 1 left the job early (it called destroy_process_group, while ValueError: rank "
                              "one blew up in its step went up)") in out0, (out0, err0)
    codes, ((out0, err0), _) = _two_ranks(FAILING_UNDER_OWN_HOOK, tmp_path)
    assert codes[0] == 3 and "rank 1 failed with ValueError: rank one blew up" in out0, (out0, err0)
    # An exception caught after such a `finally:` (an early stop) is no failure: rank 0 finishes its work.
    codes, outputs = _two_ranks(HANDLED_IN_FINALLY, tmp_path)
    assert codes == [0, 0] and all(out == "clean\n" for out, _ in outputs), outputs


FROZEN_STORE_HOST = textwrap.dedent("""
    import os, signal, time, torch, ddpkit
    world = ddpkit.init_process_group(backend="gloo", timeout=4, stall_seconds=60)
    ddpkit.Comm.for_group().all_reduce(torch.ones(1), "hello")
    if world.rank == 0:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen, with the store it hosts: a hung node, a network split
    start = time.monotonic()
    try:
        ddpkit.Comm.for_group().all_reduce(torch.ones(1), "waiting for rank 0")
    except ddpkit.StallError as exc:
        print(f"raised after {time.monotonic() - start:.1f} s: {exc}", flush=True)
        raise SystemExit(3)
""")


def test_a_frozen_store_host_ends_the_others_with_the_timeout_error(tmp_path):
    """Rank 0 stops (SIGSTOP) with the TCPStore it hosts: a store call never returns (TCPStore's timeout bounds only
    waits for keys), and the other rank, explaining its timed-out collective, blocked in one for ever. Now every
    store call made while reporting, and at exit, gives up after a few seconds."""
    from helpers.world import free_port

    script = tmp_path / "frozen.py"
    script.write_text(FROZEN_STORE_HOST)
    port = free_port()
    env = {**os.environ, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        out1, err1 = procs[1].communicate(timeout=90)
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate()
    assert procs[1].returncode == 3, (out1, err1)
    waited = float(out1.split("raised after ")[1].split(" s")[0])
    assert waited < 4 + 15, out1
    assert "waited in collective #2 all_reduce (waiting for rank 0)" in out1, out1
    assert "the job's store did not answer within 5 s either" in out1, out1


def test_a_store_host_that_left_is_named_not_a_bare_connection_error(tmp_path):
    """Rank 0 ends; what it would post lives in the store it hosts, which goes with it: rank 1 got gloo's bare
    'Connection closed by peer' (hang review). Now the error says the store's host ended."""
    codes, (_, (out1, err1)) = _two_ranks(STORE_HOST_LEAVES, tmp_path)
    assert codes[1] == 3, (out1, err1)
    assert "PeerVanishedError: the job's store no longer answers" in out1, out1
    assert "rank 0's (or the launcher's), has most likely ended" in out1 and "collective #2 all_reduce" in out1, out1


HANDLED_PEER_FAILURE = textwrap.dedent("""
    import time
    import torch.distributed as dist
    from ddpkit.doctor.inspector import StallMonitor
    from ddpkit.errors import PeerFailedError

    # the monitor looks again at the end of each grace period (5 s by default); a 1 s one looks twice during
    # the handling
    GRACE_S = 1.0
    store = dist.HashStore()
    monitor = StallMonitor(store, rank=0, world_size=2, threshold_s=60, poll_s=0.2, grace_s=GRACE_S)
    store.set("ddpkit/monitor/failed/1", "Traceback: rank 1 ran out of memory")
    store.add("ddpkit/monitor/failures", 1)
    try:
        while True:
            time.sleep(0.05)
    except PeerFailedError:
        print("caught", flush=True)
    time.sleep(GRACE_S + 2)  # handling it (an emergency save, say), in no collective
    print("handled", flush=True)
""")


def test_a_handled_peer_failure_is_not_cut_short(tmp_path):
    """The monitor ends a process only when its main thread is stuck in a collective, not while it handles the
    PeerFailedError it was given."""
    script = tmp_path / "handled.py"
    script.write_text(HANDLED_PEER_FAILURE)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["caught", "handled"], done.stdout
    assert "rank 1 failed" in done.stderr and "ran out of memory" in done.stderr


def slow_then_gone(world):
    """Rank 1 is slow at a first barrier (explained, then resolved), then leaves before the next collective:
    rank 0's error must be about the second collective, not the stale explanation of the first."""
    import ddpkit

    comm = ddpkit.Comm.for_group()
    if world.rank == 1:
        time.sleep(STALL_S + 2)
    comm.barrier("first barrier")
    if world.rank == 1:
        time.sleep(1)
        ddpkit.destroy_process_group()  # gone: its connections close under rank 0's next collective
        return "left"
    try:
        pending = comm.all_reduce(torch.ones(1), "second", async_op=True)
        time.sleep(STALL_S + 1)  # launched long ago, as a bucket is during backward; the wait itself is short
        comm.wait(pending)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_resolved_stall_is_not_blamed_later_and_the_rank_that_left_is():
    text, left = run_world(slow_then_gone, 2, collective_timeout_s=TIMEOUT_S, stall_seconds=STALL_S, deadline_s=90)
    assert left == "left"
    assert text.startswith("PeerLeftError: rank 1 left the job early (it called destroy_process_group) after "
                           "collective #1 barrier (first barrier): the root cause"), text
    assert "Rank 0 was in collective #2 all_reduce (second)" in text, text
    assert "StallError" not in text and "has waited" not in text, text  # not the stale explanation of #1


def test_only_a_rank_that_left_before_the_collective_is_named_its_root_cause():
    """Rank 1 left after collective #3; rank 2 joined #5 and every later one, then ended normally. Rank 0's #5
    failed: rank 1 is the root cause, not rank 2."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from ddpkit.doctor.inspector import StallMonitor
    from ddpkit.doctor.rank_states import Board

    store = dist.HashStore()
    monitor = StallMonitor(store, rank=0, world_size=3, threshold_s=60, poll_s=60, exit_on_peer_failure=False)
    try:
        for rank, seq in ((1, 3), (2, 9)):
            Board(store, monitor.board.prefix, rank, 3).post_left(
                {"rank": rank, "how": "it called destroy_process_group", "seq": seq, "what": f"op {seq}"})
        record = SimpleNamespace(seq=5, op="all_reduce", what="loss")
        error = monitor._explain_failure(record, RuntimeError("Connection closed by peer"), waited=0.1)
    finally:
        monitor.stop()
    assert type(error).__name__ == "PeerLeftError", error
    assert str(error).startswith("rank 1 left the job early (it called destroy_process_group) after collective #3 "
                                 "op 3: the root cause. Rank 0 was in collective #5 all_reduce (loss)"), error
    assert "rank 2" not in str(error), error
