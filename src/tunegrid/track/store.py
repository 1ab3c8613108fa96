"""The MLflow store: one resolver of its URI for every rule, the client, and retries for a busy store.

Precedence, everywhere: the study's tracking.tracking_uri, then $MLFLOW_TRACKING_URI, then the sqlite
store under results/. tracking-init resolves it once and writes it (credentials redacted) to
tracking.json; every later rule reads the store from there.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

log = logging.getLogger("tunegrid.track")


T = TypeVar("T")

# MLflow's error codes for a request it refuses for what it holds (a bad name, a value too long): sending it
# again cannot help, unlike a store that is busy or down
REFUSAL_CODES = frozenset({"INVALID_PARAMETER_VALUE", "BAD_REQUEST"})


def is_refusal(exc: BaseException) -> bool:
    return getattr(exc, "error_code", None) in REFUSAL_CODES


def default_store_uri() -> str:
    """results/mlflow.db of the folder the workflow runs in (resolved once, by tracking-init)."""
    return f"sqlite:///{Path.cwd().resolve() / 'results' / 'mlflow.db'}"


def resolve_tracking_uri(configured: str = "") -> str:
    """Config value, then MLFLOW_TRACKING_URI, then the sqlite store under results/."""
    return configured or os.environ.get("MLFLOW_TRACKING_URI", "") or default_store_uri()


def redact_uri(uri: str) -> str:
    """A URI fit for logs and files: any user:password part is dropped."""
    parts = urlsplit(uri)
    if parts.username or parts.password:
        host = parts.hostname or ""
        if parts.port:
            host += f":{parts.port}"
        return urlunsplit((parts.scheme, "***@" + host, parts.path, parts.query, parts.fragment))
    return uri


def tracking_uri_for_cells(tracking: dict[str, Any]) -> str:
    """The store a cell logs to: the one tracking.json names, unless its credentials were redacted."""
    uri = tracking["tracking_uri"]
    return resolve_tracking_uri() if "***@" in uri else uri


def experiment_name(study: dict[str, Any]) -> str:
    return study["tracking"]["experiment"] or f"tunegrid/{study['study']}"


def with_retries(call: Callable[[], T], what: str, attempts: int = 6, first_wait_s: float = 0.2) -> T:
    """Retry a store call with backoff: sqlite says 'database is locked' under concurrent writers."""
    wait = first_wait_s
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except Exception as exc:  # MlflowException, sqlalchemy OperationalError, connection errors
            if attempt == attempts or is_refusal(exc):
                raise
            log.debug("%s failed (%s), retry %d in %.1fs", what, exc, attempt, wait)
            time.sleep(wait)
            wait = min(wait * 2, 5.0)
    raise AssertionError("unreachable")


def import_client() -> None:
    """Import what a cell's MLflow run needs (the client, the SQL store, the system-metrics monitor): ~2 CPU-s,
    which the warm supervisor pays once so that the supervisors it forks do not (tunegrid.run.warm_jobs). Only
    imports: an engine or thread made here would not survive the fork."""
    import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
    import mlflow.system_metrics.system_metrics_monitor  # noqa: F401
    from mlflow.tracking import MlflowClient  # noqa: F401


def client(uri: str) -> Any:
    # A tracking server that is down must not stall a cell for minutes inside MLflow's own HTTP
    # retries: ours (with_retries) are enough. A user's explicit setting wins.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def init_experiment(uri: str, name: str, artifact_root: Path | None) -> str:
    """Create the store and the study's experiment once, before cells fan out.

    Concurrent first writers to a fresh sqlite store crash on table creation, and concurrent
    set_experiment calls for a new name can put runs into 'Default'; so this runs in one job.
    """
    c = client(uri)
    existing = with_retries(lambda: c.get_experiment_by_name(name), "get_experiment")
    if existing is not None:
        if existing.lifecycle_stage == "deleted":
            c.restore_experiment(existing.experiment_id)
        return str(existing.experiment_id)
    location = artifact_root.resolve().as_uri() if artifact_root is not None and uri.startswith("sqlite") else None
    return str(with_retries(lambda: c.create_experiment(name, artifact_location=location), "create_experiment"))
