"""The merged trace: every rank's events as one Chrome trace event file (Perfetto and chrome://tracing open it).

One process per rank ("rank 0", "rank 1", ...), each with two tracks: compute (the main thread's phases, waits
nested inside them) and communication (each collective from when it was issued to when it finished). A backend
may run two collectives at once (gloo has two threads per group): a second one that starts before the first ends
goes on a lane of its own ("communication 2"), because a track's slices must nest. Times are microseconds on
rank 0's clock from the earliest event. otherData.ddpkit holds the ranks, the steps asked for (A, B), the last
step the run completed (below A or B when it ended first) and the clock alignment with its error.
"""

from __future__ import annotations

import datetime
import json
import time
from typing import Any

from ddpkit._utils.atomic import replacing

COMPUTE, COMM = 0, 1  # track (thread) ids
TRACK_NAMES = {COMPUTE: "compute", COMM: "communication"}


def publish(store: Any, prefix: str, rank: int, payload: dict[str, Any]) -> None:
    store.set(f"{prefix}events/{rank}", json.dumps(payload))


def gather(store: Any, prefix: str, world_size: int, timeout_s: float) -> dict[int, dict[str, Any]]:
    """Every rank's posted events, waiting up to `timeout_s` in all; a rank still missing then is left out (the
    trace's otherData names it)."""
    found: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        for rank in range(world_size):
            key = f"{prefix}events/{rank}"
            if rank not in found and store.check([key]):
                found[rank] = json.loads(store.get(key))
        if len(found) == world_size or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


def build_trace(payloads: dict[int, dict[str, Any]], world_size: int, steps: list[int],
                last_step: int | None = None) -> dict[str, Any]:
    """The Chrome trace (JSON object format) of every rank's events (`Timeline.payload`, on rank 0's clock);
    `steps` = [A, B] as asked, `last_step` the last optimizer step the run completed (None: not known)."""
    starts = [e[4] for p in payloads.values() for e in p["events"]]
    origin = min(starts) if starts else 0.0
    events: list[dict[str, Any]] = []
    for rank in sorted(payloads):
        found = _rank_events(rank, payloads[rank]["events"], origin)
        events += _metadata(rank, max((e["tid"] for e in found), default=COMM))
        events += sorted(found, key=lambda e: (e["ts"], -e.get("dur", 0)))
    clock = {str(rank): {"offset_ms": 1e3 * p["clock_offset_s"], "error_ms": 1e3 * p["clock_error_s"]}
             for rank, p in sorted(payloads.items())}
    meta = {"ranks": sorted(payloads), "world_size": world_size,
            "missing_ranks": sorted(set(range(world_size)) - set(payloads)), "steps": steps, "last_step": last_step,
            "clock": clock, "clock_error_ms": max((c["error_ms"] for c in clock.values()), default=0.0),
            "clock_note": "each rank's offset to rank 0 from the fastest of a few store round trips; the error is "
                          "half that round trip, a bound on how far two ranks' times may be misaligned",
            "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"ddpkit": meta}}


def _metadata(rank: int, last_lane: int) -> list[dict[str, Any]]:
    found = [{"ph": "M", "pid": rank, "tid": 0, "name": "process_name", "args": {"name": f"rank {rank}"}},
             {"ph": "M", "pid": rank, "tid": 0, "name": "process_sort_index", "args": {"sort_index": rank}}]
    names = {**TRACK_NAMES, **{tid: f"communication {tid}" for tid in range(COMM + 1, last_lane + 1)}}
    for tid, name in names.items():
        found.append({"ph": "M", "pid": rank, "tid": tid, "name": "thread_name", "args": {"name": name}})
        found.append({"ph": "M", "pid": rank, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
    return found


def _rank_events(rank: int, raw: list[list], origin: float) -> list[dict[str, Any]]:
    out = []
    lanes: list[float] = []  # when each communication lane is free again
    for ph, tid, name, cat, began, ended, args in sorted(raw, key=lambda e: (e[1], e[4])):
        if tid == COMM:
            lane = next((i for i, free in enumerate(lanes) if free <= began), len(lanes))
            lanes[lane:lane + 1] = [ended]
            tid = COMM + lane
        event = {"name": name, "cat": cat, "ph": ph, "pid": rank, "tid": tid, "ts": _us(began - origin)}
        if ph == "i":
            event["s"] = "t"
        else:
            event["dur"] = _us(ended - began)
        if args:
            event["args"] = args
        out.append(event)
    return out


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def write_json(path: str, value: Any, indent: int | None = None) -> None:
    with replacing(path) as f:
        json.dump(value, f, indent=indent)
