"""Run a function on N gloo ranks on the CPU, with a deadline, and bring back each rank's result.

    results = run_world(check_something, world_size=2, args=(seed,))

`fn(world, *args)` runs on every rank after `ddpkit.init_process_group(backend="gloo")`; `world` is the
`DistEnv`. Its return value (picklable) comes back in rank order. If any rank raises, the others are killed
and the test fails with that rank's traceback; if the deadline passes, every rank is killed and the test fails
naming the ranks that had not finished. No process or port outlives the call.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

DEFAULT_DEADLINE_S = 120.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    """Results of `fn(world, *args)` on each rank, in rank order.

    expect_errors=True returns the per-rank outcome instead of failing: ("ok", value) or ("error", text).
    """
    # fork starts a rank in a fraction of a second (torch is already imported); spawn is for CUDA.
    method = start_method or os.environ.get("DDPKIT_TEST_START_METHOD", "fork")
    ctx = mp.get_context(method)
    results = ctx.Queue()
    port = _free_port()
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
