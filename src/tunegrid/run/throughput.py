"""A distributed cell's throughput from its ranks' metrics.jsonl: what its run sees, and each rank's own."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any


def step_records(metrics_path: Path) -> dict[int, tuple[int, float]]:
    """step -> (the rank's real tokens, its step wall time), from its metrics.jsonl (tokens = tokens/s x time)."""
    steps = {}
    for record in metric_records(metrics_path):
        seconds, rate = record.get("step_time_s"), record.get("tokens_per_s")
        if isinstance(seconds, (int, float)) and isinstance(rate, (int, float)) and seconds > 0:
            steps[int(record["step"])] = (round(rate * seconds), float(seconds))
    return steps


def cell_throughput(per_rank: dict[int, dict[int, tuple[int, float]]]) -> dict[str, Any]:
    """A distributed cell's throughput as its run sees it: each step's real tokens over all ranks, over the
    step's wall time on its slowest rank (the median over the steps every rank timed, step 0 left out as in a
    one-process cell), with each rank's own figures beside it."""
    if not per_rank:
        return {}
    steps = sorted(set.intersection(*(set(steps) for steps in per_rank.values())) - {0})
    rates = [sum(per_rank[r][s][0] for r in per_rank) / max(per_rank[r][s][1] for r in per_rank) for s in steps]
    walls = [max(per_rank[r][s][1] for r in per_rank) for s in steps]
    own = {}
    for rank, timed in per_rank.items():
        mine = [timed[s] for s in sorted(timed) if s != 0]
        own[str(rank)] = {
            "tokens_per_s_median": statistics.median(t / w for t, w in mine) if mine else None,
            "step_time_s_median": statistics.median(w for _, w in mine) if mine else None,
        }
    return {
        "tokens_per_s_median": statistics.median(rates) if rates else None,
        "step_time_s_median": statistics.median(walls) if walls else None,
        "measured_as": "all ranks' real tokens per step / the slowest rank's step wall time",
        "per_rank": own,
    }


def metric_records(metrics_path: Path) -> list[dict[str, Any]]:
    if not metrics_path.exists():
        return []
    records = []
    for line in metrics_path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a killed rank
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    return records
