"""The benchmark's summary, pure: per-round step times in, medians, ratios and a table out."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from ddpkit.bench.workloads import WORKLOADS

RATIOS = (("ddpkit", "torch"), ("ddpkit", "bare"))


def summarise(world_size: int, name: str, measured: dict[str, Any]) -> dict[str, Any]:
    """Medians in ms and ratios from one model's per-round step times (seconds) on rank 0."""
    row = {"world_size": world_size, "model": name, "about": WORKLOADS[name].about, "params": measured["params"],
           "tensors": measured["tensors"]}
    for clock, prefix in (("wall", ""), ("cpu", "cpu_")):
        steps = measured[clock]
        variants = list(steps)
        ratios = RATIOS + tuple((v, "ddpkit") for v in ("inspected", "timeline") if v in steps)
        round_ms = {v: [1e3 * statistics.median(block) for block in steps[v]] for v in variants}
        row[prefix + "median_ms"] = {v: 1e3 * statistics.median([t for block in steps[v] for t in block])
                                     for v in variants}
        row[prefix + "ratios"] = {f"{num}/{den}": ratio_stats(round_ms[num], round_ms[den]) for num, den in ratios}
        row[prefix + "round_median_ms"] = round_ms
        row[prefix + "step_ms"] = {v: [[1e3 * t for t in block] for block in steps[v]] for v in variants}
    return row


def ratio_stats(numerator: Sequence[float], denominator: Sequence[float]) -> dict[str, Any]:
    """The ratio of two variants per round, summarised. Blocks of one round ran back to back, so each ratio
    sees roughly the same machine; the spread over rounds shows how far the machine's noise moves it."""
    per_round = [a / b for a, b in zip(numerator, denominator, strict=True)]
    return {"median": statistics.median(per_round), "min": min(per_round), "max": max(per_round),
            "rounds": per_round}


def format_table(rows: list[dict[str, Any]]) -> str:
    """Wall-clock medians and ratios [min-max over rounds], then the CPU-time ratios (medians) beside them."""
    head = (f"{'world':>5}  {'model':<11} {'params':>6} {'tensors':>7}  {'ddpkit ms':>9} {'torch ms':>9} "
            f"{'bare ms':>8}  {'ddpkit/torch':<21} {'ddpkit/bare':<21} {'cpu d/t':>7} {'cpu d/b':>7}")
    lines = [head, "-" * len(head)]
    for row in rows:
        ms = row["median_ms"]
        wall = [f"{r['median']:.3f} [{r['min']:.2f}-{r['max']:.2f}]" for r in row["ratios"].values()]
        cpu = [f"{r['median']:.3f}" for r in row["cpu_ratios"].values()]
        lines.append(f"{row['world_size']:>5}  {row['model']:<11} {_count(row['params']):>6} {row['tensors']:>7}  "
                     f"{ms['ddpkit']:>9.2f} {ms['torch']:>9.2f} {ms['bare']:>8.2f}  {wall[0]:<21} {wall[1]:<21} "
                     f"{cpu[0]:>7} {cpu[1]:>7}")
    for variant, what in (("inspected", "stall inspector"), ("timeline", "timeline")):
        found = [row for row in rows if f"{variant}/ddpkit" in row["ratios"]]
        if found:
            lines.append("")
            lines.append(f"{what} on vs off ({variant}/ddpkit: wall [min-max over rounds], cpu)")
        for row in found:
            wall, cpu = row["ratios"][f"{variant}/ddpkit"], row["cpu_ratios"][f"{variant}/ddpkit"]
            lines.append(f"{row['world_size']:>5}  {row['model']:<11} {wall['median']:.3f} "
                         f"[{wall['min']:.2f}-{wall['max']:.2f}]  cpu {cpu['median']:.3f}")
    return "\n".join(lines)


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k" if n >= 1e3 else str(n)
