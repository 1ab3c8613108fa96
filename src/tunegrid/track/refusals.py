"""What MLflow refuses of a run's record, found item by item so that the rest still lands.

MLflow refuses a whole log_batch (or create_run) for one bad item: a param or tag name with a character it
forbids, a value over its length limit (when MLFLOW_TRUNCATE_LONG_VALUES is off), a param logged again with
another value. A cell's run must still end with its outcome, so items are checked with MLflow's own validators
before they are sent, and a batch the store refuses anyway is sent again item by item. What was refused is named
by its key only, never its value: values may hold secrets.
"""

from __future__ import annotations

from typing import Any

REFUSED_TAG = "tunegrid.refused"  # on the run: the keys MLflow refused, "param <key>, tag <key>, ..."
MAX_NAME_SHOWN = 120  # a refused key may itself be the problem (too long): it is shown cut to this


def checked(kind: str, items: dict[str, str]) -> tuple[list[Any], list[str]]:
    """The params or tags (`kind` "param" or "tag") as MLflow entities it will accept (values cut to its limit
    where MLflow cuts them itself), and the keys it would refuse."""
    from mlflow.exceptions import MlflowException
    from mlflow.utils.validation import _validate_param, _validate_tag

    validate = _validate_param if kind == "param" else _validate_tag
    accepted, refused = [], []
    for key, value in items.items():
        try:
            accepted.append(validate(key, str(value)))
        except MlflowException:
            refused.append(key)
    return accepted, refused


def checked_metrics(metrics: list[Any]) -> tuple[list[Any], list[str]]:
    """The metric entities MLflow accepts, and the keys of those it would refuse."""
    from mlflow.exceptions import MlflowException
    from mlflow.utils.validation import _validate_metric

    accepted, refused = [], []
    for metric in metrics:
        try:
            _validate_metric(metric.key, metric.value, metric.timestamp, metric.step)
            accepted.append(metric)
        except MlflowException:
            refused.append(metric.key)
    return accepted, refused


def shown(kind: str, key: str) -> str:
    return f"{kind} {key[:MAX_NAME_SHOWN]}" + ("..." if len(key) > MAX_NAME_SHOWN else "")


def refused_note(refused: list[str]) -> str:
    """The REFUSED_TAG value: each refused item once, in the order met."""
    return ", ".join(dict.fromkeys(refused))
