"""Advice for collective timeouts, by their diagnosis (run/collective.py), each fix proven by a twin cell:

- long_pause: the smallest `collective_timeout_s` a twin (same cell, only the timeout changed) ran ok with;
- straggler: the twin without the slow rank (the imbalance removed); a larger timeout only delays the failure,
  and twins with one that timed out later are cited as the proof;
- mismatch: no setting fixes it; the rank and step where the ranks' paths parted.

A straggler in a cell that did not time out is an early warning (a finding, no fix), and so is a slow link: the
collectives slow while every rank kept pace (tunegrid.run.link_check).
"""

from __future__ import annotations

from typing import Any

from tunegrid.review.advice import Fix, Recommendation, ok_cells, siblings
from tunegrid.vocabulary import NO_FAULT, Outcome


def _seconds(value: Any) -> str:
    return f"{float(value):g} s"


def _timeout_twins(frame: Any, row: Any) -> tuple[Any, Any]:
    """Twins that differ only in the collective timeout: those ok, and those that timed out too."""
    if "collective_timeout_s" not in frame.columns:
        return frame.iloc[0:0], frame.iloc[0:0]
    twins = siblings(frame, row, "collective_timeout_s")
    return ok_cells(twins), twins[twins["outcome"] == Outcome.TIMEOUT]


def _long_pause(frame: Any, row: Any) -> tuple[str, list[Fix]]:
    ok, _ = _timeout_twins(frame, row)
    text = (
        f"rank {row['collective_missing_ranks']} paused once at step {int(row['collective_step'])} for longer than the "
        f"{_seconds(row['collective_timeout_s'])} timeout after keeping pace with the others (a save, an evaluation "
        "or a data load on one rank)."
    )
    if ok.empty:
        return text + " No twin with another collective_timeout_s ran ok, so none is proposed.", []
    best = ok.sort_values("collective_timeout_s").iloc[0]
    why = (
        f"collective_timeout_s {float(best['collective_timeout_s']):g}: the same cell with it ran ok (or move the "
        "pause off the collective path: every rank saves or evaluates, or one rank does it while the others wait "
        "in a barrier)"
    )
    fix = Fix({"collective_timeout_s": float(best["collective_timeout_s"])}, why, [best["cell_id"]])
    return text + f" Fix: {why}.", [fix]


def _straggler(frame: Any, row: Any) -> tuple[str, list[Fix]]:
    ok, late = _timeout_twins(frame, row)
    text = (
        f"rank {int(row['straggler_rank'])} was a straggler: {row['straggler_ratio']:.3g}x the other ranks' local "
        f"time per step before it failed to arrive at step {int(row['collective_step'])} (uneven data, a slow device)."
    )
    fixes = []
    if "fault" in frame.columns:
        balanced = ok_cells(siblings(frame, row, "fault"))
        balanced = balanced[balanced["fault"] == NO_FAULT]
        if not balanced.empty:
            why = "remove the imbalance: the same cell without the slow rank ran ok"
            fixes.append(Fix({"fault": NO_FAULT}, why, [balanced.iloc[0]["cell_id"]]))
            text += f" Fix: {why}."
    larger = late[late["collective_timeout_s"] > row["collective_timeout_s"]]
    if not larger.empty:
        later = ", ".join(
            f"{_seconds(r['collective_timeout_s'])} timed out at step {int(r['collective_step'])}"
            for _, r in larger.sort_values("collective_timeout_s").iterrows()
            if r["collective_step"] == r["collective_step"]
        )
        text += f" A larger timeout only delays the failure ({later})."
    else:
        text += " A larger timeout would only delay the failure: every step still waits for the slow rank."
    return text, fixes


def _mismatch(row: Any) -> str:
    return (
        f"the ranks took different code paths: {row['collective_parted'] or 'the flight recorder shows a mismatch'} "
        "left the path of the others, so its peers wait in a collective it never calls. No timeout or setting "
        "fixes it: look for an early exit or a conditional collective at that step (uneven data per rank, a "
        "rank-dependent branch)."
    )


def timeout_fixes(frame: Any) -> list[Recommendation]:
    """One recommendation per timed-out distributed cell, by its diagnosis; early warnings for ok cells."""
    if "collective_op" not in frame.columns:
        return []
    out = []
    for _, row in frame[(frame["outcome"] == Outcome.TIMEOUT) & frame["collective_op"].notna()].iterrows():
        kind = row.get("collective_diagnosis")
        fixes: list[Fix] = []
        if kind == "long_pause":
            text, fixes = _long_pause(frame, row)
        elif kind == "straggler":
            text, fixes = _straggler(frame, row)
        elif kind == "mismatch":
            text = _mismatch(row)
        else:  # results from before the diagnosis existed
            text = f"rank(s) {row.get('collective_missing_ranks') or 'unknown'} never reached {row['collective_op']}."
        out.append(
            Recommendation(
                signature=f"timeout:{kind or 'collective'}",
                title=f"{row['cell_id']}: collective timeout ({kind or 'undiagnosed'})",
                text=f"Collective timeout in {row['collective_op']}: " + text,
                failing=[row["cell_id"]],
                evidence=sorted({c for f in fixes for c in f.evidence}),
                fixes=fixes,
                concerns=[row["cell_id"]],
            )
        )
    if "straggler_rank" in frame.columns:
        warned = frame[(frame["outcome"] != Outcome.TIMEOUT) & frame["straggler_rank"].notna()]
        out += [
            _early_warning(
                row,
                "straggler",
                f"rank {int(row['straggler_rank'])} was {row['straggler_ratio']:.3g}x the other ranks' local time on "
                "most steps: every step waits for it, and a longer delay on it will end in a collective timeout. "
                "Balance the ranks' data or devices.",
            )
            for _, row in warned.iterrows()
        ]
    return out + _slow_links(frame)


def _slow_links(frame: Any) -> list[Recommendation]:
    """A finding per cell whose collectives were slow while no rank straggled: the network is the suspect."""
    if "slow_link_ratio" not in frame.columns:
        return []
    return [
        _early_warning(
            row,
            "slow_link",
            f"its collectives took {row['slow_link_collective_s']:.3g} s a step, {row['slow_link_ratio']:.3g}x what "
            "the probe's all-reduce bandwidth predicts, while every rank kept pace: the link between the ranks, not "
            "a rank, is slow. Check the network (interface, rate limits, placement of the ranks' nodes).",
        )
        for _, row in frame[frame["slow_link_ratio"].notna()].iterrows()
    ]


def _early_warning(row: Any, kind: str, what: str) -> Recommendation:
    """A finding on a cell that did not time out (yet): what its ranks showed, as an early warning."""
    return Recommendation(
        signature=f"warning:{kind}",
        title=f"{row['cell_id']}: {kind.replace('_', ' ')} (early warning)",
        text=f"{row['cell_id']} ended {row['outcome']}, but {what}",
        failing=[],
        evidence=[row["cell_id"]],
        concerns=[row["cell_id"]],
    )
