"""A slow link: a distributed cell whose collectives were slow while every rank computed at pace.

Each rank's step splits at its last forward (metrics.jsonl): `local_time_s` before it, the rest of `step_time_s`
after (the backward, the gradient all-reduce it joins, the optimizer). The backward is taken as BACKWARD_FACTOR x
the local time; what the rest exceeds it by is the step's collective time, and the rank that waited least in a
step says the most about the link. The probe measured the all-reduce's bus bandwidth (nccl-tests' definition:
an all-reduce of B bytes over W ranks moves 2 (W-1)/W x B per rank); from it and the gradient bytes (the trainable
parameters, fp32) follows what the collective should have taken. Where no rank is a straggler and the collective
time is SLOW_LINK_FACTOR x that prediction, and at least `straggler_min_lag_s` above it, on most steps, the network
is the suspect, not a rank (a throttled or congested link, a wrong interface).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from tunegrid.run.collective import MIN_STEPS_COMPARED

SLOW_LINK_FACTOR = 10.0
BACKWARD_FACTOR = 2.0  # a step's backward costs about twice its forward
GRAD_BYTES_PER_PARAM = 4  # DDP all-reduces the LoRA parameters' fp32 gradients


def predicted_allreduce(capabilities: dict[str, Any], world: int, grad_bytes: int) -> dict[str, Any] | None:
    """What the probe's all-reduce says `grad_bytes` should take among `world` ranks: the bus bandwidth of the size
    it measured nearest (log scale), or None where it measured none at this world size."""
    rows = ((capabilities.get("allreduce") or {}).get(str(world)) or {}).get("sizes") or []
    rows = [row for row in rows if (row.get("busbw_gbs") or 0) > 0 and (row.get("bytes") or 0) > 0]
    if not rows or grad_bytes <= 0:
        return None
    row = min(rows, key=lambda r: abs(math.log(r["bytes"]) - math.log(grad_bytes)))
    seconds = grad_bytes * 2 * (world - 1) / world / (row["busbw_gbs"] * 1e9)
    return {"seconds": seconds, "busbw_gbs": row["busbw_gbs"], "measured_at_bytes": row["bytes"]}


def find_slow_link(
    local_times: dict[int, dict[int, float]],
    step_times: dict[int, dict[int, float]],
    predicted: dict[str, Any] | None,
    min_lag_s: float,
    factor: float = SLOW_LINK_FACTOR,
) -> dict[str, Any] | None:
    """The slow-link finding (rank -> step -> seconds, for the local and the step wall times), or None: no
    prediction, too few steps every rank timed (step 0, the warm-up, left out), or collectives at pace."""
    ranks = sorted(local_times)
    if predicted is None or len(ranks) < 2 or set(ranks) != set(step_times):
        return None
    common = [set(local_times[r]) & set(step_times[r]) for r in ranks]
    steps = sorted(set.intersection(*common) - {0})
    if len(steps) < MIN_STEPS_COMPARED:
        return None
    expected = predicted["seconds"]
    collective = [
        min(max(0.0, step_times[r][s] - (1 + BACKWARD_FACTOR) * local_times[r][s]) for r in ranks) for s in steps
    ]
    slow = sum(c >= factor * expected and c - expected >= min_lag_s for c in collective)
    if slow * 2 <= len(steps):
        return None
    median = statistics.median(collective)
    found = {
        "kind": "slow_link",
        "collective_s_median": round(median, 4),
        "predicted_s": round(expected, 6),
        "ratio": round(median / expected, 1) if expected > 0 else None,
        "busbw_gbs": predicted["busbw_gbs"],
        "busbw_measured_at_bytes": predicted["measured_at_bytes"],
        "local_time_s_median_per_rank": {
            str(r): round(statistics.median(local_times[r][s] for s in steps), 4) for r in ranks
        },
        "slow_steps": slow,
        "steps_compared": len(steps),
        "factor": factor,
        "min_lag_s": min_lag_s,
    }
    return {**found, "text": describe_slow_link(found)}


def describe_slow_link(found: dict[str, Any]) -> str:
    """The finding in a sentence (result.json's `distributed.slow_link.text`)."""
    return (
        f"slow link: the collectives took {found['collective_s_median']:g} s a step, {found['ratio']:g}x what the "
        f"probe's all-reduce bus bandwidth ({found['busbw_gbs']:.3g} GB/s) predicts for the gradients, while every "
        "rank computed at pace (no straggler): the network, not a rank"
    )
