"""A smaller micro-batch that keeps the recipe: the same effective batch through gradient accumulation.

A smaller batch_size alone trains another recipe (fewer sequences per optimizer step, another gradient
noise and another learning-rate fit). Only an ok cell that ran the smaller micro-batch with the
accumulation that restores the effective batch shows such a fix; where the grid ran smaller micro-batches
only at other effective batches, the advice says so instead of proposing a setting nobody ran.
"""

from __future__ import annotations

from typing import Any

from tunegrid.vocabulary import AXES, Outcome


def accumulation(row: Any) -> int:
    """A row's grad_accum; summaries written before the axis existed ran without accumulation."""
    value = row.get("grad_accum", 1)
    return int(value) if value == value and value is not None else 1


def micro_batch_phrase(batch: int, accum: int) -> str:
    return f"batch_size {batch}" + (f" with grad_accum {accum}" if accum > 1 else "")


def _smaller_ok(frame: Any, row: Any) -> list[Any]:
    """ok cells equal to `row` on every axis but the batch's two, with a smaller micro-batch."""
    mask = (frame["outcome"] == Outcome.OK) & (frame["batch_size"] < row["batch_size"])
    for axis in AXES:
        if axis in frame.columns and axis not in ("batch_size", "grad_accum"):
            mask &= frame[axis] == row[axis]
    return [sib for _, sib in frame[mask].iterrows()]


def smaller_batch_fix(frame: Any, rows: list[Any], precision: str) -> tuple[dict[str, Any] | None, str]:
    """The largest smaller micro-batch shown ok at the failing cells' effective batch, as a fix (change, why,
    evidence); and a sentence for smaller micro-batches the grid ran only at another effective batch."""
    same: dict[tuple[int, int], set[str]] = {}
    other: dict[tuple[int, int], set[str]] = {}
    for row in rows:
        effective = int(row["batch_size"]) * accumulation(row)
        for sib in _smaller_ok(frame, row):
            key = (int(sib["batch_size"]), accumulation(sib))
            (same if key[0] * key[1] == effective else other).setdefault(key, set()).add(sib["cell_id"])
    fix = None
    if same:
        batch, accum = max(same)
        fix = {
            "change": {"batch_size": batch, "grad_accum": accum},
            "why": f"keep {precision} with {micro_batch_phrase(batch, accum)} (ok in {precision} at the same "
            f"effective batch of {batch * accum})",
            "evidence": sorted(same[(batch, accum)]),
        }
    note = ""
    if other and not same:
        batch, accum = max(other)
        effective = int(rows[0]["batch_size"]) * accumulation(rows[0])
        needed = (
            f"the grid has no cell with batch_size {batch} and grad_accum {effective // batch}"
            if effective % batch == 0
            else f"no grad_accum makes batch_size {batch} an effective batch of {effective}"
        )
        note = (
            f"{micro_batch_phrase(batch, accum)} was ok in {precision} ({', '.join(sorted(other[(batch, accum)]))}), "
            f"but at an effective batch of {batch * accum}, not {effective}: another recipe. As {needed}, it "
            "shows no smaller micro-batch that keeps the recipe."
        )
    return fix, note
