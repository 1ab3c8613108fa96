"""Why a collective timed out, from evidence the ranks leave anyway: each rank's local time per step (metrics.jsonl,
`local_time_s`: from the step's start to its last forward, before the backward joins the gradient all-reduce),
its heartbeat, the collective each waiting rank gave up in, and on GPU the flight recorder's reading
(diagnosis.RecorderReading: only a complete reading that shows ranks in different collectives decides a mismatch;
an incomplete, aborted or failed one is evidence marked as such, beside the others, never a verdict).

- `mismatch`: the ranks are in different collectives (a rank took another code path: it never calls the one its
  peers wait in). No timeout helps; the rank and step where the paths parted point at the code.
- `straggler`: the rank that did not arrive was slower than its peers on most steps before (local time at least
  `straggler_factor` x the others' median). A larger timeout only delays the failure; remove the imbalance.
- `long_pause`: the ranks kept pace until one stopped at one step for longer than the timeout (a save, an
  evaluation, a data load on one rank). A timeout above the pause, or moving the pause, fixes it.

The same straggler test runs on cells that did not time out: an early warning.
Standard library only: the supervisor runs it on the files.
"""

from __future__ import annotations

import re
import statistics
from typing import Any

from tunegrid.diagnosis import RecorderReading

STEP_RE = re.compile(r"step (\d+)")
MIN_STEPS_COMPARED = 2  # fewer steps say nothing about "most steps"


def find_straggler(
    local_times: dict[int, dict[int, float]], factor: float, min_lag_s: float = 0.0
) -> dict[str, Any] | None:
    """The rank whose local time is >= factor x the other ranks' median, and at least min_lag_s more, on more
    than half of the steps every rank completed (step 0, the warm-up, left out); None when no rank is.
    `local_times`: rank -> step -> seconds."""
    ranks = sorted(local_times)
    if len(ranks) < 2:
        return None
    steps = sorted(set.intersection(*(set(local_times[r]) for r in ranks)) - {0})
    if len(steps) < MIN_STEPS_COMPARED:
        return None
    found = []
    for rank in ranks:
        ratios, slow = [], 0
        for step in steps:
            own = local_times[rank][step]
            others = statistics.median(local_times[o][step] for o in ranks if o != rank)
            ratios.append(own / others if others > 0 else float("inf"))
            slow += ratios[-1] >= factor and own - others >= min_lag_s
        if slow * 2 > len(ratios):
            found.append(
                {
                    "rank": rank,
                    "median_ratio": round(statistics.median(ratios), 3),
                    "slow_steps": slow,
                    "steps_compared": len(ratios),
                    "factor": factor,
                    "min_lag_s": min_lag_s,
                    "local_time_s_median": round(statistics.median(local_times[rank][s] for s in steps), 4),
                    "others_local_time_s_median": round(
                        statistics.median(local_times[o][s] for o in ranks if o != rank for s in steps), 4
                    ),
                }
            )
    return max(found, key=lambda f: f["median_ratio"]) if found else None


def collective_position(record: dict[str, Any]) -> tuple[int | None, str] | None:
    """Where a rank is blocked in a collective: (step, collective) from the collective it gave up in, or from its
    last heartbeat where that names a collective; None when it is not in one (computing, pausing, gone)."""
    timed_out = (record.get("diagnosis") or {}).get("collective_timeout")
    text = timed_out["waiting_in"] if timed_out else record.get("last_heartbeat") or ""
    if not timed_out and not re.search(r"all-reduce|barrier", text):
        return None
    step = STEP_RE.search(text)
    kind = "barrier" if "barrier" in text else "all-reduce" if "all-reduce" in text else text
    return (int(step.group(1)) if step else None, kind)


def _mismatch(ranks: list[dict[str, Any]], recorder: RecorderReading | None) -> dict[str, Any] | None:
    """Ranks blocked in different collectives (CPU: what each waits in), or the flight recorder's mismatch (GPU)."""
    positions = {r["rank"]: p for r in ranks if (p := collective_position(r)) is not None}
    groups: dict[tuple[int | None, str], list[int]] = {}
    for rank, position in positions.items():
        groups.setdefault(position, []).append(rank)
    if len(groups) < 2:
        if recorder is not None and recorder.mismatch and recorder.first is not None:
            first = recorder.first
            return {
                "evidence": "flight_recorder",
                "flight_recorder_status": recorder.status,
                "flight_recorder_verdict": first.line(),
                "group": first.group_desc or first.group,
                "collective": first.collective,
                "seq": first.seq,
                "mismatch_type": first.mismatch,
                "culprit_ranks": first.missing_ranks,
            }
        return None
    # the main path: most ranks, and on a tie the one still in a training step's all-reduce
    main = max(groups, key=lambda p: (len(groups[p]), p[1] == "all-reduce"))
    parted = sorted(r for p, members in groups.items() if p != main for r in members)
    return {
        "evidence": "collectives",
        "parted_ranks": parted,
        "parted_at_step": main[0],
        "main_path": {"step": main[0], "collective": main[1], "ranks": groups[main]},
        "positions": {rank: {"step": step, "collective": kind} for rank, (step, kind) in sorted(positions.items())},
    }


def classify_timeout(
    ranks: list[dict[str, Any]],
    missing: list[int],
    step: int | None,
    timeout_s: float,
    factor: float,
    recorder: RecorderReading | None,
    min_lag_s: float = 0.0,
) -> dict[str, Any]:
    """The kind of a collective timeout and the evidence it rests on; `ranks` as rank_record gives them (with
    `local_times` and `last_heartbeat_at`), `missing` the ranks that did not arrive, `step` the timed-out one,
    `recorder` the flight recorder's reading (None where the cell keeps none)."""
    mismatch = _mismatch(ranks, recorder)
    if mismatch is not None:
        return {"kind": "mismatch", **mismatch}
    local = {r["rank"]: r["local_times"] for r in ranks}
    before = {rank: {s: t for s, t in times.items() if step is None or s < step} for rank, times in local.items()}
    straggler = find_straggler(before, factor, min_lag_s)
    if straggler is not None and (not missing or straggler["rank"] in missing):
        return {"kind": "straggler", "rank": straggler["rank"], "step": step, "before_the_stall": straggler}
    paused = missing[0] if missing else None
    record = next((r for r in ranks if r["rank"] == paused), {})
    compared = _pace(before, paused)
    return {
        "kind": "long_pause",
        "rank": paused,
        "step": step,
        "phase": record.get("last_heartbeat"),
        "timeout_s": timeout_s,
        "pace_before": compared,  # the paused rank kept pace before: its median local time over the others'
    }


def _pace(local: dict[int, dict[int, float]], rank: int | None) -> dict[str, Any]:
    """The rank's median local time over the other ranks' before the stall (about 1 when it kept pace)."""
    if rank is None or not local.get(rank):
        return {"steps_compared": 0}
    others = [t for o, times in local.items() if o != rank for s, t in times.items() if s != 0]
    own = [t for s, t in local[rank].items() if s != 0]
    if not own or not others:
        return {"steps_compared": 0}
    return {
        "steps_compared": len(own),
        "median_ratio": round(statistics.median(own) / statistics.median(others), 3),
    }


def describe(kind: dict[str, Any]) -> str:
    """One sentence for the reason: what the evidence says happened."""
    if kind["kind"] == "mismatch":
        if kind["evidence"] == "flight_recorder":
            verdict = kind["flight_recorder_verdict"]
            return f"mismatch: the flight recorder shows the ranks in different collectives ({verdict})"
        main = kind["main_path"]
        where = ", ".join(
            f"rank {r} in {p['collective']}" + (f" at step {p['step']}" if p["step"] is not None else "")
            for r, p in kind["positions"].items()
        )
        return (
            f"mismatch: rank(s) {', '.join(map(str, kind['parted_ranks']))} took another path at step "
            f"{main['step']} ({where})"
        )
    if kind["kind"] == "straggler":
        before = kind["before_the_stall"]
        return (
            f"straggler: rank {kind['rank']} was {before['median_ratio']:g}x the others' local time on "
            f"{before['slow_steps']} of {before['steps_compared']} steps before"
        )
    pace = kind["pace_before"]
    kept = f" after keeping pace ({pace['median_ratio']:g}x)" if pace.get("median_ratio") is not None else ""
    timeout = f"{kind['timeout_s']:g} s"
    return f"long_pause: rank {kind['rank']} stopped at step {kind['step']} for longer than {timeout}{kept}"
