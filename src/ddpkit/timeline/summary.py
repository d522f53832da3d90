"""Where each step's time went, from a merged trace: pure functions over its events (no processes, no torch).

Per rank and step (the step's span on the compute track; times in ms):
  compute    the main thread busy in a recorded phase (forward, backward, copies, optimizer, evaluation, saves),
             less the time it waited on a collective or on the data loader inside them
  comm       a collective in flight (issued, not yet finished), or the main thread waiting on one (a wait outlasts
             its collective by the time the woken thread takes to run again, milliseconds on a busy CPU)
  exposed    communication while the main thread computed nothing: what communication added to the step
  overlap    the share of communication hidden behind compute: 100 * (comm - exposed) / comm
  optimizer  inside optimizer.step();  data wait: blocked on the data loader;  sent: bytes given to collectives
  untracked  the rest of the step: neither compute, communication nor data wait (Python between the phases)
so step = compute + exposed + data wait + untracked, up to communication during a data wait.
Per bucket: the rank that launched its collective last (a rank launches a bucket once its gradients, and those of
every bucket before it, are ready) and how many ms after the first rank, over the steps.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any

Intervals = list[tuple[float, float]]
FIELDS = ("step_ms", "compute_ms", "comm_ms", "exposed_comm_ms", "optimizer_ms", "data_wait_ms", "untracked_ms")
NOT_BUSY = ("step", "wait", "data")  # compute-track categories that are not the main thread computing


# -- intervals ---------------------------------------------------------------------------------------------------
def union(intervals: Iterable[tuple[float, float]]) -> Intervals:
    merged: Intervals = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def clip(merged: Intervals, a: float, b: float) -> Intervals:
    return [(max(x, a), min(y, b)) for x, y in merged if y > a and x < b]


def subtract(merged: Intervals, minus: Intervals) -> Intervals:
    """`merged` less `minus` (both unions)."""
    out: Intervals = []
    for x, y in merged:
        start = x
        for a, b in minus:
            if b <= start or a >= y:
                continue
            if a > start:
                out.append((start, a))
            start = max(start, b)
        if start < y:
            out.append((start, y))
    return out


def length(merged: Intervals) -> float:
    return sum(b - a for a, b in merged)


# -- per rank ----------------------------------------------------------------------------------------------------
def _by_rank(events: list[dict[str, Any]]) -> dict[int, dict[str, list]]:
    ranks: dict[int, dict[str, list]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for e in events:
        if e.get("ph") not in ("X", "i"):
            continue
        mine = ranks[int(e["pid"])]
        ts = e["ts"] / 1e3  # ms from here on
        end = ts + e.get("dur", 0) / 1e3
        if e["tid"] >= 1:  # communication, on one lane or several (see timeline_trace)
            mine["comm"].append((ts, end, e.get("args", {}).get("bytes", 0)))
            continue
        cat = e.get("cat", "")
        if cat == "step":
            mine["steps"].append((e["args"]["step"], ts, end))
        elif cat in ("wait", "data"):
            mine[cat].append((ts, end))
        elif e["ph"] == "X":
            mine["busy"].append((ts, end))
            if cat == "optimizer":
                mine["optimizer"].append((ts, end))
            elif cat == "copy":
                mine["launches"].append((ts, e["args"]["bucket"]))
    return ranks


def step_row(mine: dict[str, list], a: float, b: float) -> dict[str, float]:
    """One rank's numbers for the step spanning [a, b] ms."""
    idle = union(mine["wait"] + mine["data"])
    busy = clip(subtract(union(mine["busy"]), idle), a, b)
    comm = clip(union([(x, y) for x, y, _ in mine["comm"]] + mine["wait"]), a, b)
    data = clip(union(mine["data"]), a, b)
    exposed = length(subtract(comm, busy))
    row = {"step_ms": b - a, "compute_ms": length(busy), "comm_ms": length(comm), "exposed_comm_ms": exposed,
           "optimizer_ms": length(clip(union(mine["optimizer"]), a, b)), "data_wait_ms": length(data),
           "untracked_ms": (b - a) - length(union(busy + comm + data)),
           "bytes_sent": sum(n for x, _, n in mine["comm"] if a <= x < b)}
    row["overlap_pct"] = overlap(row)
    return row


def overlap(row: dict[str, float]) -> float:
    return 100.0 * (row["comm_ms"] - row["exposed_comm_ms"]) / row["comm_ms"] if row["comm_ms"] > 0 else 0.0


def _mean(rows: list[dict[str, float]]) -> dict[str, float]:
    out = {key: sum(r[key] for r in rows) / len(rows) for key in (*FIELDS, "bytes_sent")}
    out["overlap_pct"] = overlap(out)
    return out


def _total(rows: list[dict[str, float]]) -> dict[str, float]:
    out = {key: sum(r[key] for r in rows) for key in (*FIELDS, "bytes_sent")}
    out["overlap_pct"] = overlap(out)
    return out


# -- stragglers ----------------------------------------------------------------------------------------------------
def stragglers(ranks: dict[int, dict[str, list]]) -> list[dict[str, Any]]:
    """Per bucket: who launched it last, and how much later than the first rank, step by step and overall."""
    launched: dict[tuple, dict[int, float]] = collections.defaultdict(dict)  # (step, bucket, nth) -> rank -> ms
    for rank, mine in ranks.items():
        seen: collections.Counter = collections.Counter()
        for ts, bucket in sorted(mine["launches"]):
            step = next((k for k, a, b in mine["steps"] if a <= ts <= b), None)
            if step is not None:
                seen[(step, bucket)] += 1
                launched[(step, bucket, seen[(step, bucket)])][rank] = ts
    per_bucket: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    for (step, bucket, nth), times in sorted(launched.items()):
        if len(times) > 1:
            last = max(sorted(times), key=times.__getitem__)
            per_bucket[bucket].append({"step": step, "last_rank": last, "late_ms": times[last] - min(times.values())})
    out = []
    for bucket, rows in sorted(per_bucket.items()):
        counts = collections.Counter(r["last_rank"] for r in rows)
        top = max(sorted(counts), key=counts.__getitem__)
        out.append({"bucket": bucket, "last_rank": top, "times_last": counts[top], "launches": len(rows),
                    "late_ms": sum(r["late_ms"] for r in rows if r["last_rank"] == top) / counts[top],
                    "max_late_ms": max(r["late_ms"] for r in rows), "steps": rows})
    return out


# -- the summary -----------------------------------------------------------------------------------------------------
def summarize(trace: dict[str, Any]) -> dict[str, Any]:
    """Per step (each rank, and their mean), per rank in total, the mean total, and the stragglers."""
    meta = trace["otherData"]["ddpkit"]
    ranks = _by_rank(trace["traceEvents"])
    numbers = sorted({k for mine in ranks.values() for k, _, _ in mine["steps"]})
    steps, totals = [], collections.defaultdict(list)
    for k in numbers:
        per_rank = {}
        for rank, mine in sorted(ranks.items()):
            span = next(((a, b) for n, a, b in mine["steps"] if n == k), None)
            if span is not None:
                per_rank[str(rank)] = step_row(mine, *span)
                totals[str(rank)].append(per_rank[str(rank)])
        steps.append({"step": k, "per_rank": per_rank, "mean": _mean(list(per_rank.values()))})
    total_per_rank = {rank: _total(rows) for rank, rows in totals.items()}
    return {"ranks": meta["ranks"], "missing_ranks": meta.get("missing_ranks", []), "steps_asked": meta["steps"],
            "last_step": meta.get("last_step"), "clock_error_ms": meta.get("clock_error_ms", 0.0), "steps": steps,
            "total": {"per_rank": total_per_rank,
                      "mean": _mean(list(total_per_rank.values())) if total_per_rank else None},
            "buckets": stragglers(ranks)}


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


HEADER = (f"{'':>6} {'step':>8} {'compute':>8} {'comm':>8} {'exposed':>8} {'overlap':>8} {'optimizer':>9} "
          f"{'data wait':>9} {'untracked':>9} {'sent':>9}")


def _line(label: str, row: dict[str, float]) -> str:
    return (f"{label:>6} {row['step_ms']:>8.2f} {row['compute_ms']:>8.2f} {row['comm_ms']:>8.2f} "
            f"{row['exposed_comm_ms']:>8.2f} {row['overlap_pct']:>7.1f}% {row['optimizer_ms']:>9.2f} "
            f"{row['data_wait_ms']:>9.2f} {row['untracked_ms']:>9.2f} {_size(row['bytes_sent']):>9}")


def _ended_early(summary: dict[str, Any]) -> str | None:
    """Whether the run stopped before the window's last step (a trace from before `last_step` was kept: None)."""
    first, last = summary["steps_asked"]
    taken = summary.get("last_step")
    if taken is None or taken >= last:
        return None
    if taken < first:
        return f"the run ended after optimizer step {taken}, before step {first}: the window was never reached"
    return f"the run ended after optimizer step {taken}, before step {last}: steps {first} to {taken} were recorded"


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as printed at the end of a recording and by `ddpkit timeline FILE`."""
    ranks = summary["ranks"]
    lines = [f"ddpkit timeline: {len(ranks)} rank(s), optimizer steps {summary['steps_asked'][0]} to "
             f"{summary['steps_asked'][1]}; clocks aligned to rank 0 within {summary['clock_error_ms']:.3f} ms"]
    ended = _ended_early(summary)
    if ended:
        lines.append(ended)
    if summary["missing_ranks"]:
        lines.append(f"missing: ranks {summary['missing_ranks']} posted no events (ended early or died)")
    if not summary["steps"]:
        return "\n".join(lines + ["no complete step was recorded"])
    lines += ["per step, mean over the ranks (ms):", HEADER]
    lines += [_line(str(s["step"]), s["mean"]) for s in summary["steps"]]
    total = summary["total"]
    lines.append(_line("total", total["mean"]))
    lines += ["per rank, all steps (ms):", HEADER.replace("      ", "  rank", 1)]
    lines += [_line(rank, row) for rank, row in sorted(total["per_rank"].items(), key=lambda kv: int(kv[0]))]
    if summary["buckets"]:
        lines.append("stragglers: per bucket, the rank that launched its all-reduce last, and how much after the "
                     "first rank")
        for b in summary["buckets"]:
            lines.append(f"  bucket {b['bucket']}: rank {b['last_rank']} last in {b['times_last']} of "
                         f"{b['launches']} launches, {b['late_ms']:.2f} ms late on average "
                         f"(worst {b['max_late_ms']:.2f})")
    return "\n".join(lines)
