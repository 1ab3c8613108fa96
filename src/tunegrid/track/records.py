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
    its charts draw no point for it); an infinity is not sent, as MLflow would store it as the largest float. Each
    step also gets `nonfinite`, the count of its metrics that were not finite, so a chart shows where they began."""
    from mlflow.entities import Metric

    metrics = []
    for rec in records:
        step, ts = int(rec["step"]), int(rec["time"] * 1000)
        nonfinite = 0
        for key in METRIC_KEYS:
            if key in rec and rec[key] is not None:
                value = float(rec[key])
                nonfinite += not math.isfinite(value)
                if not math.isinf(value):
                    metrics.append(Metric(key=key, value=value, timestamp=ts, step=step))
        metrics.append(Metric(key=NONFINITE_KEY, value=float(nonfinite), timestamp=ts, step=step))
    return metrics
