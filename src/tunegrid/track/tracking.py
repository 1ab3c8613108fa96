"""MLflow tracking: one experiment per study, one run per cell, metrics.jsonl as the source of truth.

The cell's supervisor (not the training process) talks to MLflow: it tails metrics.jsonl and sends new
points with log_batch, so training never waits on the store, and a store that was down or locked is
filled from the file afterwards (`reconcile`). Every call is retried; a store that stays down is
recorded, never fatal.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from tunegrid.study.paths import StudyPaths
from tunegrid.track.diagnosis import DIAGNOSIS_TAG, RUNNING
from tunegrid.track.records import (
    NONFINITE_KEY,
    SENT_KEYS,
    metrics_from_records,  # noqa: F401 — where the supervisor's tests read it
    step_metrics,
)
from tunegrid.track.refusals import REFUSED_TAG, checked, checked_metrics, refused_note, shown
from tunegrid.track.store import client, is_refusal, with_retries
from tunegrid.vocabulary import Outcome

log = logging.getLogger(__name__)

CELL_TAG = "tunegrid.cell_id"
FAILED: Any = object()  # what CellRun._try returns when the store call failed (None is a valid result)
REFUSED: Any = object()  # ... and when the store refused what the call holds (it is up: later calls go on)
MAX_BATCH = 1000  # MLflow's log_batch limit on metrics per call
T = TypeVar("T")


class NullRun:
    """The run of a cell whose study has tracking off: every call does nothing, so the supervisor keeps
    one path whether or not a store is there."""

    enabled = False
    uri = ""
    run_id = None
    sent_points = 0

    def __init__(self) -> None:
        self.errors: list[str] = []

    def log_records(self, records: list[dict[str, Any]]) -> bool:
        return True

    def reconcile(self, records: list[dict[str, Any]]) -> int:
        return 0

    def log_dataset(self, dataset: dict[str, Any]) -> None:
        return None

    def tag(self, tags: dict[str, str]) -> bool:
        return True

    def finish(self, *args: Any, **kwargs: Any) -> None:
        return None


class CellRun:
    """The MLflow run of one cell, driven by the supervisor."""

    enabled = True

    def __init__(self, uri: str, experiment_id: str) -> None:
        self.uri = uri
        self.experiment_id = experiment_id
        self.client = client(uri)
        self.run_id: str | None = None
        self.errors: list[str] = []
        self.refused: list[str] = []  # "param <key>" / "tag <key>" / "metric <key>" MLflow would not take
        self.sent_points = 0
        self.down = False
        self.system: Any = None  # the system-metrics monitor (track/system_metrics.py), while the cell runs

    def _try(self, call: Callable[[], T], what: str) -> T:
        """One store call with retries; once the store is found down, later calls are skipped
        (the sync rule fills the run from the files afterwards) so training is never slowed by it."""
        if self.down:
            return FAILED
        try:
            return with_retries(call, what)
        except Exception as exc:
            if is_refusal(exc):
                return REFUSED
            self.down = True
            self.errors.append(f"{what}: {type(exc).__name__}: {str(exc)[:200]}")
            log.warning("MLflow %s failed; metrics.jsonl keeps everything (%s)", what, exc)
            return FAILED

    def _refuse(self, kind: str, keys: list[str]) -> None:
        """Name what MLflow refused, in the cell's log and (by `finish`) on the run; never the value."""
        for key in keys:
            self.refused.append(shown(kind, key))
            print(f"WARNING: MLflow refused {shown(kind, key)!r}; the cell's files keep it", flush=True)

    def _send(self, kind: str, entities: list[Any], what: str, chunk_size: int = 100) -> bool:
        """log_batch in chunks; a chunk the store refuses is sent again one item at a time, so one bad item
        costs only itself. False when the store is down."""
        field = {"param": "params", "tag": "tags", "metric": "metrics"}[kind]
        for i in range(0, len(entities), chunk_size):
            chunk = entities[i : i + chunk_size]
            sent = self._try(lambda c=chunk: self.client.log_batch(self.run_id, **{field: c}), what)
            if sent is FAILED:
                return False
            if sent is REFUSED:
                for item in chunk:
                    one = self._try(lambda e=item: self.client.log_batch(self.run_id, **{field: [e]}), what)
                    if one is FAILED:
                        return False
                    if one is REFUSED:
                        self._refuse(kind, [item.key])
        return True

    def _log(self, kind: str, items: dict[str, str], what: str) -> bool:
        accepted, refused = checked(kind, items)
        self._refuse(kind, refused)
        return self._send(kind, accepted, what)

    def start(
        self, cell_id: str, tags: dict[str, str], params: dict[str, str], start_time: float | None = None
    ) -> None:
        """Open this cell's run; earlier runs of the same cell are marked superseded and deleted."""
        previous = self._try(
            lambda: self.client.search_runs([self.experiment_id], filter_string=f"tags.`{CELL_TAG}` = '{cell_id}'"),
            "search previous runs",
        )
        # the diagnosis first: MLflow lists a run's tags in the order they were first set
        first = {DIAGNOSIS_TAG: RUNNING, CELL_TAG: cell_id}
        accepted, refused = checked("tag", {**first, **tags})  # one bad tag would refuse the run
        self._refuse("tag", refused)
        run = self._try(
            lambda: self.client.create_run(
                self.experiment_id,
                start_time=_ms(start_time),
                run_name=cell_id,
                tags={t.key: t.value for t in accepted},
            ),
            "create_run",
        )
        if run is FAILED or run is REFUSED:
            return
        self.run_id = run.info.run_id
        for old in [] if previous is FAILED else previous:
            self._try(
                lambda o=old: self.client.set_tag(o.info.run_id, "tunegrid.superseded_by", self.run_id), "tag old run"
            )
            if old.info.status == "RUNNING":  # its job was killed mid-cell: say so, do not leave it running
                self._try(
                    lambda o=old: self.client.set_tag(
                        o.info.run_id, "tunegrid.ended", "killed: superseded by a re-run"
                    ),
                    "tag",
                )
                self._try(lambda o=old: self.client.set_terminated(o.info.run_id, status="KILLED"), "end old run")
            self._try(lambda o=old: self.client.delete_run(o.info.run_id), "delete superseded run")
        self._log("param", params, "log params")
        self._log("tag", {"tunegrid.status": "running"}, "tag")

    def tag(self, tags: dict[str, str]) -> bool:  # while the cell runs (a hang named before its timeout)
        return self.run_id is not None and self._log("tag", tags, "tag")

    def log_records(self, records: list[dict[str, Any]]) -> bool:
        if self.run_id is None or not records:
            return self.run_id is not None
        metrics, refused = checked_metrics(step_metrics(records))
        self._refuse("metric", sorted(set(refused)))
        if not self._send("metric", metrics, "log metrics", MAX_BATCH):
            return False
        self.sent_points += _file_points(metrics)
        return True

    def reconcile(self, records: list[dict[str, Any]]) -> int:
        """Send every metric point of metrics.jsonl that the store lacks; returns how many were sent."""
        if self.run_id is None:
            return 0
        have: set[tuple[str, int]] = set()
        for key in SENT_KEYS:
            history = self._try(lambda k=key: self.client.get_metric_history(self.run_id, k), "read history")
            if history is FAILED:
                return 0
            have.update((m.key, m.step) for m in history)
        missing, _ = checked_metrics([m for m in step_metrics(records) if (m.key, m.step) not in have])
        return _file_points(missing) if self._send("metric", missing, "reconcile metrics", MAX_BATCH) else 0

    def log_dataset(self, dataset: dict[str, Any]) -> None:
        """The training set as the run's dataset input (the UI's Dataset column), context `training`."""
        from mlflow.entities import Dataset, DatasetInput, InputTag

        if self.run_id is None:
            return
        entity = Dataset(
            name=dataset["name"],
            digest=dataset["digest"],
            source_type="local",
            source=json.dumps(dataset["source"]),
            profile=json.dumps(dataset["profile"]),
        )
        item = DatasetInput(dataset=entity, tags=[InputTag("mlflow.data.context", "training")])
        self._try(lambda: self.client.log_inputs(self.run_id, datasets=[item]), "log dataset")

    def monitor_system(self, interval_s: float) -> None:
        """MLflow's own system-metrics monitor on this run (a thread of this process), until `finish`."""
        from tunegrid.track.system_metrics import SystemMetrics

        if self.run_id is not None and not self.down:
            self.system = SystemMetrics(self.uri, self.run_id, interval_s)

    def finish(
        self,
        tags: dict[str, str],
        artifacts: list[Path],
        failed: bool,
        params: dict[str, str] | None = None,
        end_time: float | None = None,
        name: str | None = None,
        metrics: dict[str, float] | None = None,
    ) -> None:
        """Outcome tags, facts known only after training as params (e.g. the quantization audit), artifacts;
        the run renamed to carry its outcome and ended FAILED when the cell did not end ok. What MLflow refuses
        of these costs only itself: the outcome, the name and the status always land while the store is up."""
        if self.system is not None:
            self.system.stop()
            self.system = None
        if self.run_id is None:
            return
        if name:
            self._try(lambda: self.client.update_run(self.run_id, name=name), "rename run")
        if params:
            self._log("param", params, "final params")
        if metrics:  # the cell's figures, one point each, at its end
            from mlflow.entities import Metric

            at = _ms(end_time) or int(time.time() * 1000)
            entities = [Metric(key=k, value=float(v), timestamp=at, step=0) for k, v in metrics.items()]
            accepted, refused = checked_metrics(entities)
            self._refuse("metric", refused)
            self._send("metric", accepted, "final metrics")
        final_tags = {**tags, "tunegrid.status": "done"}
        if self.refused:
            final_tags[REFUSED_TAG] = refused_note(self.refused)
        self._log("tag", final_tags, "final tags")
        for path in artifacts:
            if path.is_dir():  # a folder (the adapter) keeps its name and layout in the store
                self._try(
                    lambda p=path: self.client.log_artifacts(self.run_id, str(p), artifact_path=p.name),
                    f"artifacts {path.name}",
                )
            elif path.exists():
                self._try(lambda p=path: self.client.log_artifact(self.run_id, str(p)), f"artifact {path.name}")
        status = "FAILED" if failed else "FINISHED"
        self._try(
            lambda: self.client.set_terminated(self.run_id, status=status, end_time=_ms(end_time)), "set_terminated"
        )


def _file_points(metrics: list[Any]) -> int:
    """How many of these points are metrics.jsonl's own (the `nonfinite` count is derived from them)."""
    return sum(m.key != NONFINITE_KEY for m in metrics)


def _ms(epoch_s: float | None) -> int | None:
    return int(epoch_s * 1000) if epoch_s else None


def active_run(c: Any, run_id: str | None) -> Any:
    """The store's run of that id, or None when it has none (deleted, never created, or the store is down)."""
    if not run_id:
        return None
    try:
        run = c.get_run(run_id)
    except Exception:
        return None
    return run if run.info.lifecycle_stage == "active" else None


def sync_cell(
    uri: str, experiment_id: str, result: dict[str, Any], run_dir: Path, log_path: Path | None
) -> dict[str, Any]:
    """Make the store hold this cell's run with every metric point of metrics.jsonl.

    For cells whose store was down or locked while they trained: the run is created (or completed)
    from the files, which are the source of truth.
    """
    from tunegrid.outcome import CellResult
    from tunegrid.runtime.files import read_jsonl
    from tunegrid.track.diagnosis import result_metrics
    from tunegrid.track.tags import ARTIFACT_FILES, cell_tags, result_params, run_name, run_tags, study_cell_ids

    records = read_jsonl(run_dir / "metrics.jsonl")
    record, run = CellResult.from_json(result), CellRun(uri, experiment_id)
    spec, run_id = record.cell, (record.tracking or {}).get("run_id")
    created = unfinished = False
    existing = active_run(run.client, run_id)
    if existing is not None:  # left open, or without its verdict (the store failed at the cell's end): end it now
        run.run_id = run_id
        unfinished = existing.info.status == "RUNNING" or "outcome" not in existing.data.tags
    else:
        from tunegrid.track.execution import INVOCATION_TAG, parent_run_id
        from tunegrid.track.params import split_params, study_specs

        tags = {**cell_tags(spec), "command": record.command, "tunegrid.created_by": "mlflow_sync"}
        # the params flatten result.json's cell as the run recorded it (the spec's JSON and the plan)
        params, common = split_params(record.cell_json(), study_specs(run_dir))
        study_dir = StudyPaths.of_run_dir(run_dir).study_dir
        parent = parent_run_id(uri, experiment_id, spec.study, study_dir, params=common)
        if parent:
            tags[INVOCATION_TAG] = parent
        run.start(spec.cell_id, tags, params, start_time=record.started_at)
        created = run.run_id is not None
    filled = run.reconcile(records)
    if created or unfinished:
        artifacts = [run_dir / name for name in ARTIFACT_FILES]
        run.finish(
            run_tags(record),
            artifacts + ([log_path] if log_path else []),
            failed=record.outcome != Outcome.OK,
            params=result_params(result),
            end_time=record.ended_at,
            metrics=result_metrics(result),
            name=run_name(record.outcome, spec.cell_id, study_cell_ids(run_dir)),
        )
    return {
        "run_id": run.run_id,
        "created": created,
        "completed": unfinished,
        "points_filled": filled,
        "points_in_file": len(records),
        "errors": run.errors,
        "refused": run.refused,
    }
