"""The words every stage shares, defined once: the grid's axes and their values, the metric names a step
writes, and a cell's outcomes.

The Snakefile's wildcard pattern, the recommender's axes, the MLflow metric list and the schema's enums
are derived from or checked against these (tests/house/test_vocabulary.py), so a new precision, metric or
outcome is added here only.
Light module: no imports beyond the standard library (the Snakefile reads it at parse time).
"""

from __future__ import annotations

from enum import StrEnum

# Order of the axes in a cell id; a new axis is appended here and nowhere else.
AXES = ("model", "precision", "batch_size", "quant", "seed", "world_size", "grad_accum")
PRECISIONS = ("fp32", "bf16", "fp16", "fp16-islands")
# The hardware arithmetic each precision runs its matmuls in: what decides native/emulated support on a target
# and the probe's per-precision constants. fp16-islands is fp16 with the overflowing modules kept in fp32.
PRECISION_ARITHMETIC = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "fp16-islands": "fp16"}
QUANTS = ("none", "nf4", "nf4-experts")
# Every number a step writes to metrics.jsonl (besides step and time) is an MLflow metric of that name.
METRIC_KEYS = (
    "loss",
    "grad_norm",
    "lr",
    "tokens_per_s",
    "step_time_s",
    "mem_peak_bytes",
    "loss_scale",
    "skipped_steps",
    "fp16_headroom_max_ratio",
)


class Outcome(StrEnum):
    """How a cell ended. A StrEnum: each member equals its string, as written in result.json and tags."""

    OK = "ok"  # every step trained with finite loss and correct gradients
    NAN = "nan"  # a non-finite loss or gradient ended it (or too many GradScaler skips in a row)
    OOM = "oom"  # an allocation failed, at load or in a step
    PREDICTED_OOM = "predicted_oom"  # not started: the estimate exceeds the budget and the study says skip
    TIMEOUT = "timeout"  # the wall-clock limit, no progress, or a collective that never completed
    ERROR = "error"  # anything else: a bug, a crash, a missing autograd kernel; never retried as ok
    UNSUPPORTED = "unsupported"  # not started: the target cannot run this precision or world size


OUTCOMES = tuple(outcome.value for outcome in Outcome)
FAILED = frozenset(OUTCOMES) - {Outcome.OK}


def cell_id_pattern() -> str:
    """The regex of a cell id (Snakemake's wildcard constraint): model, precision, batch, quant, seed, and
    world size and gradient accumulation where they are not 1."""
    precisions = "|".join(PRECISIONS)
    quants = "|".join(QUANTS)
    return rf"[A-Za-z0-9][A-Za-z0-9.-]*_({precisions})_bs[0-9]+_({quants})_s[0-9]+(_ws[0-9]+)?(_ga[0-9]+)?"
