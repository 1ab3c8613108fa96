"""A smaller micro-batch that keeps the recipe: the same effective batch through gradient accumulation.

A smaller batch_size alone trains another recipe (fewer sequences per optimizer step, another gradient
noise and another learning-rate fit). Only an ok cell that ran the smaller micro-batch with the
accumulation that restores the effective batch shows such a fix; where the grid ran smaller micro-batches
only at other effective batches, the advice says so instead of proposing a setting nobody ran.
"""

from __future__ import annotations

from typing import Any

from tunegrid.vocabulary import Outcome, axis_names


def accumulation(row: Any) -> int:
    """A row's grad_accum; summaries written before the axis existed ran without accumulation."""
    value = row.get("grad_accum", 1)
    return int(value) if value == value and value is not None else 1


def micro_batch_phrase(batch: int, accum: int) -> str:
    return f"batch_size {batch}" + (f" with grad_accum {accum}" if accum > 1 else "")


def _smaller_ok(frame: Any, row: Any) -> list[Any]:
    """ok cells equal to `row` on every axis but the batch's two, with a smaller micro-batch."""
    mask = (frame["outcome"] == Outcome.OK) & (frame["batch_size"] < row["batch_size"])
    for axis in axis_names():
        if axis in frame.columns and axis not in ("batch_size", "grad_accum"):
            mask &= frame[axis] == row[axis]
    return [sib for _, sib in frame[mask].iterrows()]


def _by_recipe(frame: Any, rows: list[Any]) -> tuple[dict[tuple[int, int], set[str]], dict[tuple[int, int], set[str]]]:
    """Smaller micro-batches shown ok, keyed (batch_size, grad_accum): those at the failing cells' effective
    batch, and those at another."""
    same: dict[tuple[int, int], set[str]] = {}
    other: dict[tuple[int, int], set[str]] = {}
    for row in rows:
        effective = int(row["batch_size"]) * accumulation(row)
        for sib in _smaller_ok(frame, row):
            key = (int(sib["batch_size"]), accumulation(sib))
            (same if key[0] * key[1] == effective else other).setdefault(key, set()).add(sib["cell_id"])
    return same, other


def _another_recipe(rows: list[Any], other: dict[tuple[int, int], set[str]], outcome: str) -> str:
    """Why a smaller micro-batch the grid ran ok is not advised: it trained another effective batch."""
    batch, accum = max(other)
    effective = int(rows[0]["batch_size"]) * accumulation(rows[0])
    needed = (
        f"the grid has no cell with batch_size {batch} and grad_accum {effective // batch}"
        if effective % batch == 0
        else f"no grad_accum makes batch_size {batch} an effective batch of {effective}"
    )
    return (
        f"{micro_batch_phrase(batch, accum)} {outcome} ({', '.join(sorted(other[(batch, accum)]))}), but at an "
        f"effective batch of {batch * accum}, not {effective}: another recipe. As {needed}, it shows no smaller "
        "micro-batch that keeps the recipe."
    )


def smaller_batch_fix(frame: Any, rows: list[Any], precision: str) -> tuple[dict[str, Any] | None, str]:
    """For a non-finite loss: the largest smaller micro-batch shown ok at the failing cells' effective batch,
    as a fix (change, why, evidence); or a sentence for smaller micro-batches ok only at another."""
    same, other = _by_recipe(frame, rows)
    if not same:
        return None, _another_recipe(rows, other, f"was ok in {precision}") if other else ""
    batch, accum = max(same)
    why = (
        f"keep {precision} with {micro_batch_phrase(batch, accum)} (ok in {precision} at the same effective "
        f"batch of {batch * accum})"
    )
    return {
        "change": {"batch_size": batch, "grad_accum": accum},
        "why": why,
        "evidence": sorted(same[(batch, accum)]),
    }, ""


def memory_batch_fix(frame: Any, row: Any) -> tuple[dict[str, Any] | None, str]:
    """For an out-of-memory cell: the largest smaller micro-batch that fit at its effective batch, as a fix;
    or a sentence for smaller micro-batches that fit only at another."""
    from tunegrid.units import human_bytes

    same, other = _by_recipe(frame, [row])
    if not same:
        return None, _another_recipe([row], other, "fits") if other else ""
    batch, accum = max(same)
    cells = sorted(same[(batch, accum)])
    peak = frame.loc[frame["cell_id"] == cells[0], "peak_bytes"].iloc[0]
    why = (
        f"{micro_batch_phrase(batch, accum)} fits at the same effective batch of {batch * accum} "
        f"(peak {human_bytes(peak)})"
    )
    return {"change": {"batch_size": batch, "grad_accum": accum}, "why": why, "evidence": cells}, ""
