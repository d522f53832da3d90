"""Never hang silently: stalls, order mismatches, crashed peers and diverging replicas are named."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import models
from conftest import stay_until, two_at_a_time
from spawn import run_world

TIMEOUT_S = 8  # the collective timeout (ddp_timeout) of these worlds
STALL_S = 2  # the inspector's threshold


def sleeper_in_a_step(world, done):
    """Rank 1 sleeps inside its third step while rank 0 waits for it in a bucket all-reduce."""
    import ddpkit

    torch.manual_seed(0)
    ddp = ddpkit.DistributedDataParallel(models.MLP(), bucket_cap_mb=0.002)
    start = None
    try:
        for step in range(4):
            x, y = models.batch("mlp", 4, seed=step)
            loss = models.loss("mlp", ddp, x, y, world.rank, step)
            if world.rank == 1 and step == 2:
                # the culprit: away until rank 0 has given up (at its timeout), or far longer than the timeout
                stay_until(done, TIMEOUT_S + 6)
                return ("stayed away", 0.0, "")
            start = time.monotonic()
            loss.backward()
    except ddpkit.StallError as exc:
        return ("stall", time.monotonic() - start, str(exc))
    except Exception as exc:  # noqa: BLE001 - any other error is the wrong outcome, shown as it is
        return ("other", 0.0, f"{type(exc).__name__}: {exc}")
    finally:
        if world.rank == 0:
            open(done, "w").close()
    return ("finished", 0.0, "")


def test_stall_names_the_rank_and_the_collective(tmp_path):
    rank0, _ = run_world(sleeper_in_a_step, 2, args=(str(tmp_path / "done"),), collective_timeout_s=TIMEOUT_S,
                         stall_seconds=STALL_S, deadline_s=90)
    kind, waited, text = rank0
    assert kind == "stall", rank0
    assert waited <= TIMEOUT_S + 5, f"the error came {waited:.1f} s after the wait began"
    assert "ranks that never arrived: [1]" in text, text
    assert "all_reduce (bucket" in text and "backward 3" in text, text
    # rank 1's stack, down to the line it sleeps on
    assert "sleeper_in_a_step" in text and "stay_until(done" in text and "time.sleep" in text, text


MISMATCH_SCRIPT = textwrap.dedent("""
    import time, torch, ddpkit
    world = ddpkit.init_process_group(backend="gloo", timeout=300)  # the inspector's default threshold: 60 s
    comm = ddpkit.Comm.for_group()
    comm.all_reduce(torch.ones(1), "warm-up")
    if world.rank == 1:
        time.sleep(1.5)  # arrives last
    print(f"ENTER {time.time():.3f}", flush=True)
    try:
        if world.rank == 0:
            comm.barrier("checkpoint saved")  # the classic bug
        comm.all_reduce(torch.ones(4), "metrics")
    except ddpkit.StallError as exc:
        print(f"RAISED {type(exc).__name__} {time.time():.3f}", flush=True)
        print(exc, flush=True)
        raise SystemExit(3)
    print("no error", flush=True)
""")


def run_pair(tmp_path, text: str, deadline_s: float = 60) -> list[tuple[int, str, str, float]]:
    """Run `text` as ranks 0 and 1 of a world (plain processes, no launcher); (exit status, stdout, stderr,
    unix time it ended) per rank. Every process is reaped."""
    from ddpkit.env import free_port

    script = tmp_path / "pair.py"
    script.write_text(text)
    port = free_port()
    procs = []
    try:
        for rank in range(2):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "OMP_NUM_THREADS": "1"}
            env.pop("TORCHELASTIC_ERROR_FILE", None)
            procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        results = []
        end = time.monotonic() + deadline_s
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, end - time.monotonic()))
            results.append((proc.returncode, out, err, time.time()))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_order_mismatch_ends_both_ranks_at_once_with_the_report(tmp_path):
    """rank 0 in a barrier, rank 1 in an all-reduce at the same position: certain, so over in seconds, far
    below the 60 s threshold and the 300 s timeout."""
    (rc0, out0, err0, _), (rc1, out1, err1, _) = run_pair(tmp_path, MISMATCH_SCRIPT)
    entered = max(float(out.split("ENTER ")[1].split()[0]) for out in (out0, out1))
    # rank 1 (the highest) ends the deadlock: it exits with the report; rank 0's collective breaks, it raises it
    assert rc1 == 1 and "no rank can progress: ending the job now" in err1, (out1, err1)
    assert rc0 == 3 and "RAISED DeadlockError" in out0, (out0, err0)
    raised = float(out0.split("RAISED DeadlockError ")[1].split()[0])
    print(f"last rank entered the mismatch -> rank 0 raised the report: {raised - entered:.2f} s")
    assert raised - entered < 20, f"{raised - entered:.1f} s: not the certain-deadlock path"
    for text in (out0, err1):
        assert "ORDER MISMATCH at collective #2: rank 0 called barrier (checkpoint saved) where rank 1 called " \
               "all_reduce (metrics)" in text, text
        assert 'comm.barrier("checkpoint saved")' in text and 'comm.all_reduce(torch.ones(4), "metrics")' in text


def corrupted_replica(world):
    import ddpkit

    torch.manual_seed(0)
    ddp = ddpkit.DistributedDataParallel(models.MLP())
    ddp.check_replicas()
    if world.rank == 2:
        with torch.no_grad():
            ddp.module.net[2].bias[3] += 1e-6
    try:
        ddp.check_replicas()
    except ddpkit.ReplicaDivergenceError as exc:
        return str(exc)
    return "not detected"


def test_replica_divergence_names_rank_and_parameter():
    for text in run_world(corrupted_replica, 3):
        assert "rank 2" in text and "'net.2.bias'" in text, text


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
    from ddpkit.env import free_port

    script = tmp_path / "crash.py"
    script.write_text(script_text)
    port = free_port()
    procs = []
    try:
        for rank in range(2):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "OMP_NUM_THREADS": "1"}
            procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        outputs = [proc.communicate(timeout=60) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [proc.returncode for proc in procs], outputs


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
    from ddpkit.env import free_port

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
    from ddpkit.monitor import PeerFailedError, StallMonitor

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

    from ddpkit.board import Board
    from ddpkit.monitor import StallMonitor

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


# ---------------------------------------------------------------------------------------------------------
# From outside: the launcher's summary
# ---------------------------------------------------------------------------------------------------------

MISBEHAVE = str(os.path.join(os.path.dirname(__file__), "scripts", "misbehave.py"))


@pytest.fixture(scope="module")
def misbehaved(tmp_path_factory):
    """Both launches of misbehave.py, side by side (each keeps its deadline): by mode, its finished future."""
    from test_launch import LAUNCH, run

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
    assert "rank 0 called all_reduce (eval loss) where rank 1 called barrier (save_model)" in summary, summary
    assert "trainer.evaluate()" in summary and "trainer.save_model()" in summary, summary  # and from where
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


# ---------------------------------------------------------------------------------------------------------
# A long wait: explained again and again, then the timeout
# ---------------------------------------------------------------------------------------------------------


def long_sleeper(world, done):
    """Rank 1 sleeps past the 10 s timeout (until rank 0 is done, at most 14 s); rank 0 waits in a barrier,
    explained at 1, 2, 4 and 8 s."""
    import ddpkit

    comm = ddpkit.Comm.for_group()
    if world.rank == 1:
        stay_until(done, 14)
        return "slept"
    start = time.monotonic()
    try:
        comm.barrier("after the long load")
    except ddpkit.StallError as exc:
        return (time.monotonic() - start, type(exc).__name__, str(exc))
    finally:
        open(done, "w").close()
    return "no error"


def test_a_long_wait_is_explained_at_growing_intervals_then_times_out(capfd, tmp_path):
    outcome, _ = run_world(long_sleeper, 2, args=(str(tmp_path / "done"),), collective_timeout_s=10,
                           stall_seconds=1, deadline_s=90, expect_errors=True)
    status, value = outcome
    assert status == "ok", value
    waited, kind, text = value
    assert kind == "StallError" and 9 <= waited <= 15, value  # still ends at the timeout, with the explanation
    assert "ranks that never arrived: [1]" in text and "stay_until(done, 14)" in text, text
    printed = [float(s) for s in re.findall(r"\[ddpkit rank 0\] rank 0 has waited (\d+) s in collective",
                                            capfd.readouterr().err)]
    assert len(printed) == 4, printed  # at 1, 2, 4 and 8 s (16 s is past the timeout)
    for seen, due in zip(printed, (1, 2, 4, 8), strict=True):
        assert due <= seen <= due + 2, printed  # polled once a second: at most a poll late


def test_the_interpreter_exits_cleanly_while_the_inspector_polls():
    """The abort at exit after a worker had finished (issue 9): the inspector's daemon thread, inside a store
    call when the interpreter finalized. It polls here as fast as it can, so that the old code aborted in about
    half of the runs; six clean exits in a row."""
    script = os.path.join(os.path.dirname(__file__), "scripts", "exit_while_polling.py")
    for _ in range(6):
        done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and done.stdout == "exiting\n", (done.returncode, done.stderr[-2000:])
        assert "terminate called" not in done.stderr


def again_on_the_same_store(world):
    """A process group of the same ranks made again on the same store (destroy_process_group, then
    init_process_group, under torchrun's agent store; here two new_group calls): the second group's inspector
    must not read what the first one's posted when its ranks left it."""
    import torch.distributed as dist

    from ddpkit.comm import Comm
    from ddpkit.monitor import attach_stall_monitor

    first = Comm.for_group(dist.new_group([0, 1]))
    attach_stall_monitor(first, TIMEOUT_S, STALL_S)
    for _ in range(3):
        first.barrier("first group")
    first.close_observers()  # each rank's inspector posts that it left, after collective #3
    second = Comm.for_group(dist.new_group([0, 1]))
    attach_stall_monitor(second, TIMEOUT_S, STALL_S)
    for _ in range(6):  # past the first group's last sequence number
        second.barrier("second group")
    if world.rank == 1:
        time.sleep(2.5)  # two polls of rank 0's inspector while it waits, well within the timeout
    start = time.monotonic()
    second.barrier("after the sleep")
    waited = time.monotonic() - start
    second.close_observers()
    return waited


def test_a_process_group_made_again_on_the_same_store_does_not_see_the_old_ones_leave():
    waited = run_world(again_on_the_same_store, 2, collective_timeout_s=TIMEOUT_S, stall_seconds=STALL_S,
                       deadline_s=90)
    assert waited[0] > 1.5, waited  # rank 0 really waited over a poll of its inspector, and was not ended
