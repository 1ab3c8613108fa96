"""A smaller micro-batch that keeps the recipe: the same effective batch through gradient accumulation.

A smaller batch_size alone trains another recipe (fewer sequences per optimizer step, another gradient
noise and another learning-rate fit). Only an ok cell that ran the smaller micro-batch with the
accumulation that restores the effective batch shows such a fix; where the grid ran smaller micro-batches
only at other effective batches, the advice says so instead of proposing a setting nobody ran.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tunegrid.review.advice import holds, no_evidence, parity_of, parity_text, unproven_name
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


def _by_recipe(
    frame: Any, rows: list[Any], accept: Callable[[Any], bool]
) -> tuple[dict[tuple[int, int], list[Any]], dict[tuple[int, int], set[str]], list[str]]:
    """Smaller micro-batches shown ok, keyed (batch_size, grad_accum): those at the failing cells' effective
    batch whose cells `accept` takes as evidence, those at another, and the names of the ok ones at the same
    effective batch that are no evidence."""
    same: dict[tuple[int, int], list[Any]] = {}
    other: dict[tuple[int, int], set[str]] = {}
    unproven: list[str] = []
    for row in rows:
        effective = int(row["batch_size"]) * accumulation(row)
        for sib in _smaller_ok(frame, row):
            key = (int(sib["batch_size"]), accumulation(sib))
            if key[0] * key[1] != effective:
                other.setdefault(key, set()).add(sib["cell_id"])
            elif accept(sib):
                same.setdefault(key, []).append(sib)
            else:
                unproven.append(unproven_name(sib))
    return same, other, unproven


def _notes(
    rows: list[Any], same: dict, other: dict[tuple[int, int], set[str]], unproven: list[str], outcome: str
) -> str:
    """What is no evidence; and, where no smaller micro-batch keeps the recipe, the ones that changed it."""
    parts = [no_evidence("A smaller micro-batch at the same effective batch", unproven)] if unproven else []
    parts += [_another_recipe(rows, other, outcome)] if other and not same else []
    return " ".join(parts)


def _fix(batch: int, accum: int, cells: list[Any], why: str) -> dict[str, Any]:
    parities = [p for p in (parity_of(c) for c in cells) if p is not None]
    shown = parity_text(max(cells, key=lambda c: parity_of(c) or 0.0))
    return {
        "change": {"batch_size": batch, "grad_accum": accum},
        "why": why + (f", {shown}" if shown else ""),
        "evidence": sorted({c["cell_id"] for c in cells}),
        "parity": max(parities) if parities else None,
    }


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
    """For a non-finite loss: the largest smaller micro-batch shown ok (quality holds) at the failing cells'
    effective batch, as a fix (change, why, evidence, parity); and sentences on what is no evidence and on
    smaller micro-batches ok only at another effective batch."""
    same, other, unproven = _by_recipe(frame, rows, holds)
    note = _notes(rows, same, other, unproven, f"was ok in {precision}")
    if not same:
        return None, note
    batch, accum = max(same)
    why = (
        f"keep {precision} with {micro_batch_phrase(batch, accum)} (ok in {precision} at the same effective "
        f"batch of {batch * accum})"
    )
    return _fix(batch, accum, same[(batch, accum)], why), note


def memory_batch_fix(frame: Any, row: Any, accept: Callable[[Any], bool] = holds) -> tuple[dict[str, Any] | None, str]:
    """For an out-of-memory cell: the largest smaller micro-batch that fit at its effective batch and that
    `accept` takes as evidence, as a fix; and sentences on what is no evidence and on smaller micro-batches
    that fit only at another effective batch."""
    from tunegrid.units import human_bytes

    same, other, unproven = _by_recipe(frame, [row], accept)
    note = _notes([row], same, other, unproven, "fits")
    if not same:
        return None, note
    batch, accum = max(same)
    cells = sorted(same[(batch, accum)], key=lambda c: c["cell_id"])
    why = (
        f"{micro_batch_phrase(batch, accum)} fits at the same effective batch of {batch * accum} "
        f"(peak {human_bytes(cells[0]['peak_bytes'])})"
    )
    return {
        "change": {"batch_size": batch, "grad_accum": accum},
        "why": why,
        "evidence": [c["cell_id"] for c in cells],
    }, note
