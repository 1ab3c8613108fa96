"""What a cell's files become in MLflow: its spec as params (flattened to names MLflow accepts) and its
metrics.jsonl as metric points (non-finite values as MLflow can hold them, with a per-step count of them)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from typing import Any

from tunegrid.outcome import METRIC_KEYS

# What MLflow accepts in a param name: a dict keyed otherwise (a model's init_scale globs, "*.mlp.*") is one
# param of its JSON, or the whole run's params would be refused
PARAM_NAME = re.compile(r"^[A-Za-z0-9_\-. :/]+$")


def flatten(prefix: str, value: Any, out: dict[str, str]) -> dict[str, str]:
    if isinstance(value, dict) and all(PARAM_NAME.match(str(key)) for key in value):
        for key, item in value.items():
            flatten(f"{prefix}.{key}" if prefix else str(key), item, out)
    elif isinstance(value, dict):  # values over MLflow's length limit are cut or refused by its own check
        out[prefix] = json.dumps(value, sort_keys=True)
    else:
        out[prefix] = str(value)
    return out


NONFINITE_KEY = "nonfinite"  # per step: how many of the step's metrics were not finite (0 at a clean step)
SENT_KEYS = (*METRIC_KEYS, NONFINITE_KEY)


def metrics_from_records(records: Iterable[dict[str, Any]]) -> list[Any]:
    """metrics.jsonl lines -> mlflow Metric entities. A NaN is kept (a NaN loss is a fact; MLflow keeps it, though
    its charts draw no point for it); an infinity is not sent, as MLflow would store it as the largest float."""
    from mlflow.entities import Metric

    return [
        Metric(key=key, value=value, timestamp=int(rec["time"] * 1000), step=int(rec["step"]))
        for rec in records
        for key, value in _values(rec)
        if not math.isinf(value)
    ]


def nonfinite_counts(records: Iterable[dict[str, Any]]) -> list[Any]:
    """Per step, `nonfinite`: how many of its metrics were not finite, so a chart shows where they began."""
    from mlflow.entities import Metric

    return [
        Metric(
            key=NONFINITE_KEY,
            value=float(sum(not math.isfinite(value) for _, value in _values(rec))),
            timestamp=int(rec["time"] * 1000),
            step=int(rec["step"]),
        )
        for rec in records
    ]


def step_metrics(records: list[dict[str, Any]]) -> list[Any]:
    """What a cell run gets of metrics.jsonl: its points, and the per-step count of non-finite ones."""
    return metrics_from_records(records) + nonfinite_counts(records)


def _values(rec: dict[str, Any]) -> list[tuple[str, float]]:
    return [(key, float(rec[key])) for key in METRIC_KEYS if rec.get(key) is not None]
