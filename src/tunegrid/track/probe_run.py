"""The probe (the host's measured capabilities) as an MLflow run of its own."""

from __future__ import annotations

import logging
import time
from typing import Any

from tunegrid.track.records import flatten
from tunegrid.track.store import client, with_retries

log = logging.getLogger(__name__)


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
