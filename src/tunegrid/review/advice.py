"""The shape of a piece of advice and the comparisons every rule of the recommender makes: a fix (one
changed setting, its reason, the ok cells that show it), a recommendation (the failing cells, the
evidence, its alternatives), and the sibling cells that differ from a cell in one axis only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tunegrid.review.quality import HOLDS, NO_REFERENCE
from tunegrid.vocabulary import Outcome, axis_names


@dataclass
class Fix:
    """One alternative: the settings to change, why, and the ok cells that show it working."""

    change: dict[str, Any]  # axis -> value
    why: str
    evidence: list[str]
    # the largest loss deviation of the evidence from its reference twin (review/quality.py); None: not compared
    parity: float | None = None
    # same grid: {"tokens_per_s_ratio", "peak_bytes_ratio", "against": the precision it was measured against}
    cost: dict[str, Any] | None = None


@dataclass
class Recommendation:
    signature: str  # what failed, e.g. "nan:fp16"
    title: str
    text: str
    failing: list[str]  # cells that did not end ok
    evidence: list[str]
    fixes: list[Fix] = field(default_factory=list)  # alternatives, each on its own; empty = a finding only
    concerns: list[str] = field(default_factory=list)  # cells the advice is about, failed or not

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def axes_of(frame: Any) -> list[str]:
    return [a for a in axis_names() if a in frame.columns]


def siblings(frame: Any, row: Any, vary: str) -> Any:
    """Cells equal to `row` on every axis but `vary`."""
    mask = frame[vary] != row[vary]
    for axis in axes_of(frame):
        if axis != vary:
            mask &= frame[axis] == row[axis]
    return frame[mask]


def ok_cells(frame: Any) -> Any:
    return frame[frame["outcome"] == Outcome.OK]


def paren(value: Any) -> str:
    """ " (value)", or nothing for an empty value: no "()" in what a person reads."""
    return f" ({value})" if value is not None and value == value and str(value) else ""


def number(value: Any) -> float:
    return float(value) if value is not None and value == value else float("inf")


def holds(row: Any) -> bool:
    """An ok cell that is evidence of a fix; a summary without quality columns (older) counts ok alone."""
    return "quality" not in row.index or row["quality"] == HOLDS


def unreferenced(row: Any) -> bool:
    """An ok cell that learned but has no ok reference twin to check its loss against."""
    return "quality" in row.index and row["quality"] == NO_REFERENCE


def parity_of(row: Any) -> float | None:
    """The cell's loss deviation from its reference twin (review/quality.py), where one was compared."""
    value = row.get("loss_deviation")
    return float(value) if value is not None and value == value else None


def parity_text(row: Any) -> str:
    deviation = parity_of(row)
    if deviation is None:
        return ""
    note = row.get("quality_note")
    judged = f"; {note}" if isinstance(note, str) and note else ""
    return f"loss within {deviation:.1%} of its reference {row.get('reference_cell')}{judged}"


def unproven_name(row: Any) -> str:
    return f"{row['cell_id']} ({row.get('quality')})"


def no_evidence(what: str, names: list[str]) -> str:
    """The sentence for ok twins that are no evidence of a fix (they did not learn, or deviate)."""
    return (
        f"{what} ran ok in {', '.join(sorted(set(names)))}: no evidence of a fix "
        "(a fix must learn and match the reference)."
    )
