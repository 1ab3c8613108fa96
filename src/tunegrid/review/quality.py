"""Did an `ok` cell learn, and did it learn what its reference learned? The columns that make an ok cell
evidence of a fix, or not.

`ok` says a cell ran correctly (every step finite, correct gradients); it does not say the cell trained
anything. A fix is a claim, so the recommender cites only cells whose `quality` is `holds`:

- the curve judged (`trained_curve`): step 0's loss, the model before any update, then the loss of every step
  that follows an update. A step the GradScaler skipped (inf/nan gradients under fp16) changed
  no weight, so the loss after it is left out: the k-th loss is the model after k updates in every cell, and an
  fp16 cell is judged on the steps that trained, not on its scaler's warm-up. `quality_note` says how many were
  left out.
- `loss_fall`: 1 - (mean loss over the last quarter of that curve) / (loss of step 0). The last quarter's mean
  smooths the batch-to-batch noise of a per-step loss. `learned` is `loss_fall >= review.min_loss_fall`.
- `reference_cell`: the cell's reference twin, the same model, batch, grad_accum, seed and world size at the
  study's reference settings (`review.reference`, default fp32 without quantization); every cell of a study
  trains on the same data, and the same seed draws the same batches at every step, so the two curves are
  comparable step by step.
- `loss_deviation`: the mean over the last quarter of the updates both made of |loss - reference loss| /
  |reference loss|. The last quarter, because that is what the run delivers (early steps differ by the
  warm-up); relative, so one tolerance fits any loss scale.
  `within_tolerance` is `loss_deviation <= review.loss_tolerance`.
- `quality`: `holds` (learned and within tolerance), `did not learn`, `deviates`, `no reference` (no ok
  twin at the reference settings), or `too few updates` (no loss was measured after an update: nothing to
  judge); empty for a cell that did not end ok.

These are columns of summary.csv / summary.parquet (the summary is where cells meet), so every consumer of
the summary (the recommender, the report) reads the same verdict.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tunegrid.vocabulary import Outcome, axis_names

QUALITY_COLUMNS = (
    "loss_fall",
    "learned",
    "reference_cell",
    "loss_deviation",
    "within_tolerance",
    "quality",
    "quality_note",
)
HOLDS = "holds"
NO_REFERENCE = "no reference"
TOO_FEW_UPDATES = "too few updates"


def default_review() -> dict[str, Any]:
    """The review settings of a summary built without a study: the schema's defaults."""
    from tunegrid.study.config import load_schema

    properties = load_schema()["properties"]["review"]["properties"]
    settings = {name: spec["default"] for name, spec in properties.items() if name != "reference"}
    settings["reference"] = {name: spec["default"] for name, spec in properties["reference"]["properties"].items()}
    return settings


def loss_curve(metric_lines: Sequence[Mapping[str, Any]]) -> list[float]:
    """The step losses of metrics.jsonl in step order (a resumed cell's lines are its whole curve)."""
    by_step = {int(line["step"]): float(line["loss"]) for line in metric_lines if "loss" in line and "step" in line}
    return [by_step[step] for step in sorted(by_step)]


def trained_curve(metric_lines: Sequence[Mapping[str, Any]]) -> tuple[list[float], int]:
    """The curve quality judges, and the skipped steps it leaves out: step 0's loss (before any update), then
    the loss of each step whose previous step applied its update. A step's `skipped_steps` is the running count
    of steps that applied none (in an ok cell, the GradScaler's skips); lines without it skipped nothing."""
    by_step = {
        int(line["step"]): (float(line["loss"]), int(line.get("skipped_steps") or 0))
        for line in metric_lines
        if "loss" in line and "step" in line
    }
    ordered = [by_step[step] for step in sorted(by_step)]
    counts = [0] + [count for _, count in ordered]  # the running count before each step, then after the last
    curve = [loss for index, (loss, _) in enumerate(ordered) if index == 0 or counts[index] == counts[index - 1]]
    return curve, counts[-1]


def _tail(values: Sequence[float]) -> Sequence[float]:
    return values[len(values) - max(1, len(values) // 4) :]


def loss_fall(curve: Sequence[float]) -> float | None:
    if len(curve) < 2 or not curve[0]:
        return None
    tail = _tail(curve)
    return 1.0 - (sum(tail) / len(tail)) / curve[0]


def loss_deviation(curve: Sequence[float], reference: Sequence[float]) -> float | None:
    steps = min(len(curve), len(reference))
    if not steps:
        return None
    pairs = _tail(list(zip(curve[:steps], reference[:steps], strict=True)))
    return sum(abs(a - b) / abs(b) for a, b in pairs if b) / len(pairs)


def _finite(value: float | None) -> bool:
    return value is not None and value == value and abs(value) != float("inf")


def quality_note(curve: Sequence[float], skipped: int) -> str | None:
    """What the verdict was judged on, where skipped steps were left out of it."""
    if not skipped:
        return None
    updates = max(0, len(curve) - 1)
    left_out = f"{skipped} step{'s' * (skipped != 1)} the GradScaler skipped left out"
    if not updates:
        return f"{left_out}: no loss was measured after an update"
    return f"{left_out}: judged on the loss before and after {updates} update{'s' * (updates != 1)}"


def quality_columns(
    rows: Sequence[Mapping[str, Any]],
    curves: Mapping[str, Sequence[float]],
    review: Mapping[str, Any],
    skipped: Mapping[str, int] | None = None,
) -> list[dict[str, Any]]:
    """Per row (in order) its quality columns; `rows` are summary rows (axes, outcome, cell_id); `curves` the
    curves judged (trained_curve), `skipped` the skipped steps each left out."""
    skipped = skipped or {}
    reference = review["reference"]
    shared = [axis for axis in axis_names() if axis not in reference]  # a twin differs only where the reference says
    twins = {
        tuple(row.get(axis) for axis in shared): row["cell_id"]
        for row in rows
        if row["outcome"] == Outcome.OK and all(row.get(axis) == value for axis, value in reference.items())
    }
    out = []
    for row in rows:
        if row["outcome"] != Outcome.OK:
            out.append(dict.fromkeys(QUALITY_COLUMNS))
            continue
        curve = curves.get(row["cell_id"]) or []
        fall = loss_fall(curve)
        learned = _finite(fall) and fall >= review["min_loss_fall"]
        twin = twins.get(tuple(row.get(axis) for axis in shared))
        deviation = loss_deviation(curve, curves.get(twin) or []) if twin else None
        within = _finite(deviation) and deviation <= review["loss_tolerance"] if twin else None
        if len(curve) < 2:  # no loss after an update: neither learned nor not
            verdict = TOO_FEW_UPDATES
        elif not learned:
            verdict = "did not learn"
        elif twin is None:
            verdict = NO_REFERENCE
        else:
            verdict = HOLDS if within else "deviates"
        out.append(
            {
                "loss_fall": fall,
                "learned": bool(learned),
                "reference_cell": twin,
                "loss_deviation": deviation,
                "within_tolerance": within,
                "quality": verdict,
                "quality_note": quality_note(curve, skipped.get(row["cell_id"], 0)),
            }
        )
    return out
