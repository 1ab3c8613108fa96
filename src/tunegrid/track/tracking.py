"""MLflow tracking: one experiment per study, one run per cell, metrics.jsonl as the source of truth.

The cell's supervisor (not the training process) talks to MLflow: it tails metrics.jsonl and sends new
points with log_batch, so training never waits on the store, and a store that was down or locked is
filled from the file afterwards (`reconcile`). Every call is retried; a store that stays down is
recorded, never fatal.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from tunegrid.outcome import METRIC_KEYS
from tunegrid.study_paths import StudyPaths
from tunegrid.track.store import client, with_retries
from tunegrid.vocabulary import Outcome

log = logging.getLogger(__name__)

CELL_TAG = "tunegrid.cell_id"
FAILED: Any = object()  # what CellRun._try returns when the store call failed (None is a valid result)
MAX_BATCH = 1000  # MLflow's log_batch limit on metrics per call
T = TypeVar("T")


# What MLflow accepts in a param name: a dict keyed otherwise (a model's init_scale globs, "*.mlp.*") is one
# param of its JSON, or the whole run's params would be refused
PARAM_NAME = re.compile(r"^[A-Za-z0-9_\-. :/]+$")


def flatten(prefix: str, value: Any, out: dict[str, str]) -> dict[str, str]:
    if isinstance(value, dict) and all(PARAM_NAME.match(str(key)) for key in value):
        for key, item in value.items():
            flatten(f"{prefix}.{key}" if prefix else str(key), item, out)
    elif isinstance(value, dict):
        out[prefix] = json.dumps(value, sort_keys=True)[:6000]
    else:
        out[prefix] = str(value)[:6000]
    return out


def metrics_from_records(records: Iterable[dict[str, Any]]) -> list[Any]:
    """metrics.jsonl lines -> mlflow Metric entities (non-finite values kept: a NaN loss is a fact)."""
    from mlflow.entities import Metric

    metrics = []
    for rec in records:
        step, ts = int(rec["step"]), int(rec["time"] * 1000)
        for key in METRIC_KEYS:
            if key in rec and rec[key] is not None:
                metrics.append(Metric(key=key, value=float(rec[key]), timestamp=ts, step=step))
    return metrics


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
            self.down = True
            self.errors.append(f"{what}: {type(exc).__name__}: {str(exc)[:200]}")
            log.warning("MLflow %s failed; metrics.jsonl keeps everything (%s)", what, exc)
            return FAILED

    def start(
        self, cell_id: str, tags: dict[str, str], params: dict[str, str], start_time: float | None = None
    ) -> None:
        """Open this cell's run; earlier runs of the same cell are marked superseded and deleted."""
        from mlflow.entities import Param, RunTag

        previous = self._try(
            lambda: self.client.search_runs([self.experiment_id], filter_string=f"tags.`{CELL_TAG}` = '{cell_id}'"),
            "search previous runs",
        )
        run = self._try(
            lambda: self.client.create_run(
                self.experiment_id, start_time=_ms(start_time), run_name=cell_id, tags={CELL_TAG: cell_id, **tags}
            ),
            "create_run",
        )
        if run is FAILED:
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
        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):
            chunk = items[i : i + 100]
            self._try(lambda c=chunk: self.client.log_batch(self.run_id, params=c), "log params")
        self._try(lambda: self.client.log_batch(self.run_id, tags=[RunTag("tunegrid.status", "running")]), "tag")

    def log_records(self, records: list[dict[str, Any]]) -> bool:
        if self.run_id is None or not records:
            return self.run_id is not None
        metrics = metrics_from_records(records)
        for i in range(0, len(metrics), MAX_BATCH):
            chunk = metrics[i : i + MAX_BATCH]
            if self._try(lambda c=chunk: self.client.log_batch(self.run_id, metrics=c), "log metrics") is FAILED:
                return False
            self.sent_points += len(chunk)
        return True

    def reconcile(self, records: list[dict[str, Any]]) -> int:
        """Send every metric point of metrics.jsonl that the store lacks; returns how many were sent."""
        if self.run_id is None:
            return 0
        have: set[tuple[str, int]] = set()
        for key in METRIC_KEYS:
            history = self._try(lambda k=key: self.client.get_metric_history(self.run_id, k), "read history")
            if history is FAILED:
                return 0
            have.update((m.key, m.step) for m in history)
        missing = [m for m in metrics_from_records(records) if (m.key, m.step) not in have]
        for i in range(0, len(missing), MAX_BATCH):
            chunk = missing[i : i + MAX_BATCH]
            if self._try(lambda c=chunk: self.client.log_batch(self.run_id, metrics=c), "reconcile metrics") is FAILED:
                return 0
        return len(missing)

    def log_dataset(self, dataset: dict[str, Any]) -> None:
        """The training set as the run's dataset input (the UI's Dataset column), context `training`."""
        import json

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
    ) -> None:
        """Outcome tags, facts known only after training as params (e.g. the quantization audit), artifacts;
        the run renamed to carry its outcome and ended FAILED when the cell did not end ok."""
        from mlflow.entities import Param, RunTag

        if self.system is not None:
            self.system.stop()
            self.system = None
        if self.run_id is None:
            return
        if name:
            self._try(lambda: self.client.update_run(self.run_id, name=name), "rename run")
        tag_items = [RunTag(k, v[:5000]) for k, v in tags.items()] + [RunTag("tunegrid.status", "done")]
        self._try(lambda: self.client.log_batch(self.run_id, tags=tag_items), "final tags")
        if params:
            items = [Param(k, v[:6000]) for k, v in params.items()]
            self._try(lambda: self.client.log_batch(self.run_id, params=items), "final params")
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


def _ms(epoch_s: float | None) -> int | None:
    return int(epoch_s * 1000) if epoch_s else None


def run_exists(c: Any, run_id: str | None) -> bool:
    if not run_id:
        return False
    try:
        return c.get_run(run_id).info.lifecycle_stage == "active"
    except Exception:
        return False


def sync_cell(
    uri: str, experiment_id: str, result: dict[str, Any], run_dir: Path, log_path: Path | None
) -> dict[str, Any]:
    """Make the store hold this cell's run with every metric point of metrics.jsonl.

    For cells whose store was down or locked while they trained: the run is created (or completed)
    from the files, which are the source of truth.
    """
    from tunegrid.files import read_jsonl
    from tunegrid.track.tags import ARTIFACT_FILES, axis_tags, result_params, run_name, run_tags, spec_id

    records = read_jsonl(run_dir / "metrics.jsonl")
    run = CellRun(uri, experiment_id)
    run_id = (result.get("tracking") or {}).get("run_id")
    created = False
    if run_exists(run.client, run_id):
        run.run_id = run_id
    else:
        from tunegrid.track.execution import INVOCATION_TAG, parent_run_id

        spec = result["cell"]
        tags = axis_tags(spec["axes"])
        tags.update(study=spec["study"], command=result.get("command", ""), **{"tunegrid.created_by": "mlflow_sync"})
        parent = parent_run_id(uri, experiment_id, spec["study"], StudyPaths.of_run_dir(run_dir).study_dir)
        if parent:
            tags[INVOCATION_TAG] = parent
        run.start(spec["cell_id"], tags, flatten("", spec, {}), start_time=result.get("started_at"))
        created = run.run_id is not None
    filled = run.reconcile(records)
    if created:
        artifacts = [run_dir / name for name in ARTIFACT_FILES]
        run.finish(
            run_tags(result),
            artifacts + ([log_path] if log_path else []),
            failed=result["outcome"] != Outcome.OK,
            params=result_params(result),
            end_time=result.get("ended_at"),
            name=run_name(result["outcome"], spec_id(result)),
        )
    return {
        "run_id": run.run_id,
        "created": created,
        "points_filled": filled,
        "points_in_file": len(records),
        "errors": run.errors,
    }


def log_probe_run(uri: str, experiment_id: str, record: dict[str, Any]) -> str | None:
    """The probe as a run of its own (tag kind=probe); every cell's run links to it by id."""
    from mlflow.entities import Metric, Param, RunTag

    c = client(uri)
    try:
        run = with_retries(
            lambda: c.create_run(experiment_id, run_name="probe", tags={"kind": "probe", "device": record["device"]}),
            "probe run",
        )
        params = [
            Param(k, v)
            for k, v in flatten("", {"precision": record["precision"], "cpu": record["cpu"]["model"]}, {}).items()
        ]
        metrics = [
            Metric(f"matmul_tflops.{k}", v, int(time.time() * 1000), 0) for k, v in record["matmul_tflops"].items() if v
        ]
        if record.get("memory_bandwidth_gbs"):
            metrics.append(Metric("memory_bandwidth_gbs", record["memory_bandwidth_gbs"], int(time.time() * 1000), 0))
        for world, facts in record["allreduce"].items():
            for row in facts.get("sizes", []) if isinstance(facts, dict) else []:
                metrics.append(
                    Metric(f"allreduce_busbw_gbs.ws{world}", row["busbw_gbs"], int(time.time() * 1000), row["bytes"])
                )
        with_retries(
            lambda: c.log_batch(
                run.info.run_id, metrics=metrics, params=params, tags=[RunTag("tunegrid.status", "done")]
            ),
            "probe batch",
        )
        with_retries(lambda: c.set_terminated(run.info.run_id), "probe end")
        return str(run.info.run_id)
    except Exception as exc:  # the probe's JSON is the record; MLflow is a view of it
        log.warning("MLflow probe run not logged: %s", exc)
        return None
