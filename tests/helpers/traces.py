"""Hand-made timeline traces: events and per-rank payloads as the recorder writes them, and one whole trace
whose summary the tests know by heart."""

from __future__ import annotations

from ddpkit.timeline.trace import build_trace


def x_event(name, cat, t0, t1, tid=0, args=None):
    return ["X", tid, name, cat, t0, t1, args]


def payload(rank, events, offset=0.0, error=0.0):
    return {"rank": rank, "clock_offset_s": offset, "clock_error_s": error, "events": events}


def hand_trace():
    """Two ranks, one step each of 10 ms (seconds below). Rank 0: data 0-1, forward 1-3, backward 3-8 with a
    wait 7-8, optimizer 8-9; an all-reduce in flight 5-8 (hidden 5-7, exposed 7-8) and a blocking one 9-9.5
    (exposed). Rank 1: the same, but it launches bucket 0 2 ms later (at 6 instead of 4)."""
    ms = 1e-3
    payloads = {}
    for rank, launch_at in ((0, 4), (1, 6)):
        events = [x_event("step 1", "step", 0, 10 * ms, args={"step": 1}),
                  x_event("data wait", "data", 0, 1 * ms), x_event("forward", "forward", 1 * ms, 3 * ms),
                  x_event("backward", "backward", 3 * ms, 8 * ms),
                  x_event("copy in bucket 0", "copy", launch_at * ms, (launch_at + 0.5) * ms, args={"bucket": 0}),
                  x_event("wait", "wait", 7 * ms, 8 * ms), x_event("opt", "optimizer", 8 * ms, 9 * ms),
                  x_event("all_reduce (bucket 0)", "collective", 5 * ms, 8 * ms, tid=1, args={"bytes": 1000}),
                  x_event("all_reduce (loss)", "collective", 9 * ms, 9.5 * ms, tid=1, args={"bytes": 8}),
                  ["i", 0, "bucket ready", "bucket", launch_at * ms, launch_at * ms, {"bucket": 0}]]
        payloads[rank] = payload(rank, events, error=0.1 * ms * rank)
    return build_trace(payloads, 2, [1, 1])
