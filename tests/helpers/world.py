"""Processes in the tests: a launcher's environment scrubbed of foreign variables, free ports, reaping a launched
process group, and `run_world`, which runs a function on N gloo ranks with a deadline.

    results = run_world(check_something, world_size=2, args=(seed,))
    proc = subprocess.Popen([...], env=clean_env(OMP_NUM_THREADS="1"), start_new_session=True)
    ...
    reap(proc)                                      # in a finally block: SIGTERM, then SIGKILL to its session

`run_world`: `fn(world, *args)` runs on every rank after `ddpkit.init_process_group(backend="gloo")`; `world` is
the `DistEnv`. Its return value (picklable) comes back in rank order. If any rank raises, the others are killed
and the test fails with that rank's traceback; if the deadline passes, every rank is killed and the test fails
naming the ranks that had not finished. No process or port outlives the call.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing as mp
import os
import queue
import re
import signal
import subprocess
import sys
import time
import types
import traceback
from typing import Any, Callable

import pytest
from torch.distributed.elastic.utils.distributed import get_free_port as free_port  # noqa: F401 - for the tests

# The scripts that tests launch as workers.
SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")


# Variables a surrounding launcher (or CI under SLURM) may have set; every launch in the tests starts without them.
FOREIGN_VARS = re.compile(r"^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|ROLE_.*|MASTER_ADDR|"
                          r"MASTER_PORT|TORCHELASTIC_.*|SLURM_.*|PET_.*|OMPI_.*|PMI_.*|OMP_NUM_THREADS|"
                          r"GLOO_SOCKET_IFNAME|ACCELERATE_.*)$")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without FOREIGN_VARS, plus `extra`: what a launch in a test starts with."""
    env = {k: v for k, v in os.environ.items() if not FOREIGN_VARS.match(k)}
    env.update(extra)
    return env


def reap(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """Stop a process started with start_new_session=True the way a user would (SIGTERM to its session, which a
    launcher forwards to its workers), then SIGKILL what is left of the session, and wait for it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


# -- run_world: N gloo ranks in forked processes ------------------------------------------------------------------
DEFAULT_DEADLINE_S = 120.0


def _rank_main(fn, rank, world_size, port, args, env, results, collective_timeout_s, backend, stall_seconds):
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    import torch

    torch.set_num_threads(1)  # ranks share two cores; more threads per rank only contend
    import ddpkit

    try:
        world = ddpkit.init_process_group(backend=backend, timeout=collective_timeout_s,
                                          device_type="cuda" if backend == "nccl" else "cpu",
                                          stall_seconds=stall_seconds)
        try:
            value = fn(world, *args)
        finally:
            ddpkit.destroy_process_group()
        results.put((rank, "ok", value))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_world(fn: Callable[..., Any], world_size: int = 2, args: tuple = (), env: dict | None = None,
              deadline_s: float = DEFAULT_DEADLINE_S, collective_timeout_s: float = 60.0,
              expect_errors: bool = False, backend: str = "gloo", start_method: str | None = None,
              stall_seconds: float | None = None) -> list[Any]:
    """Results of `fn(world, *args)` on each rank, in rank order. expect_errors=True returns the per-rank
    outcome instead of failing: ("ok", value) or ("error", text)."""
    # fork starts a rank in a fraction of a second (torch is already imported); spawn is for CUDA.
    method = start_method or os.environ.get("DDPKIT_TEST_START_METHOD", "fork")
    ctx = mp.get_context(method)
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(fn, rank, world_size, port, args, env or {}, results, collective_timeout_s,
                               backend, stall_seconds))
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    end = time.monotonic() + deadline_s
    try:
        while len(outcomes) < world_size:
            left = end - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(outcomes))
                raise TimeoutError(f"ranks {missing} did not finish within {deadline_s:.0f} s; "
                                   f"finished: {sorted(outcomes)}")
            try:
                rank, status, value = results.get(timeout=min(left, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in outcomes and p.exitcode is not None]
                if dead and results.empty():
                    time.sleep(0.2)  # a result may still be in flight through the pipe
                    if results.empty():
                        codes = {r: procs[r].exitcode for r in dead}
                        raise RuntimeError(f"ranks died without a result (exit codes {codes})")
                continue
            outcomes[rank] = (status, value)
            if status == "error" and not expect_errors:
                raise AssertionError(f"rank {rank} failed:\n{value}")
    finally:
        for proc in procs:
            proc.join(timeout=5 if len(outcomes) == world_size else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        results.close()
        results.join_thread()
    if expect_errors:
        return [outcomes[r] for r in range(world_size)]
    return [outcomes[r][1] for r in range(world_size)]


# -- comparing models: what the DDP and ZeRO tests check against single-process truth -----------------------------
def two_at_a_time(runs: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Each run (a launch that keeps its own deadline) on one of two threads; by name, its finished future, whose
    result() raises the run's failure in the test that reads it. Launches spend much of their time importing on
    one core, so a second one fills the other."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(fn) for name, fn in runs.items()}
    return futures  # all done: leaving the pool waited for them


def stay_until(path: str, limit_s: float = 60.0) -> None:
    """Sleep until `path` exists (another rank says it is done), for at most `limit_s`: a rank that must not
    join a collective stays up without a fixed sleep (gone earlier, it would close the connection its peer
    waits on)."""
    end = time.monotonic() + limit_s
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.05)


def communicate_all(procs: list, proc: subprocess.Popen, deadline_s: float) -> tuple[str, str]:
    """proc's output once it ends; past the deadline, whether each process still runs (and what) and its output so
    far, in the failure (a two-node launch that did not end once said nothing of which node, nor why)."""
    try:
        return proc.communicate(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        states = [_still_running(other) for other in procs]  # which one hung, and what it left running
        for other in procs:
            other.kill()
        seen = "\n----\n".join(f"[{state}]\n{out}\n{err}" for state, (out, err) in
                                zip(states, (other.communicate() for other in procs)))
        pytest.fail(f"did not end within {deadline_s} s; each process's state and output so far:\n{seen}")


def _still_running(proc: subprocess.Popen) -> str:
    """`proc`'s exit status, or that it still runs, with every process under it (pid and command line)."""
    if proc.poll() is not None:
        return f"pid {proc.pid} exited with {proc.returncode}"
    from ddpkit._utils.procfs import descendants

    found = []
    for pid in [proc.pid, *descendants(proc.pid)]:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            found.append(f"{pid}: {f.read().replace(bytes(1), b' ').decode(errors='replace')[:160]}")
    return "still running: " + "; ".join(found)


def run_pair(tmp_path, text: str, deadline_s: float = 60) -> list[tuple[int, str, str, float]]:
    """Run `text` as ranks 0 and 1 of a world (plain processes, no launcher); (exit status, stdout, stderr,
    unix time it ended) per rank. Every process is reaped."""
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


# -- the real launcher, to the end ---------------------------------------------------------------------------------

LAUNCH = [sys.executable, "-m", "ddpkit", "launch"]
DEADLINE_S = 120


def start(cmd, env=None, **kw) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env or clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, **kw)


def run(cmd, env=None, timeout=DEADLINE_S) -> types.SimpleNamespace:
    """Run to completion within `timeout`; the exit status, both streams and the wall time."""
    began = time.monotonic()
    proc = start(cmd, env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        reap(proc)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} passed its {timeout} s deadline\nstdout:\n{out}\nstderr:\n{err}")
    finally:
        reap(proc)
    return types.SimpleNamespace(rc=proc.returncode, out=out, err=err, wall=time.monotonic() - began,
                                 ended=time.time())
