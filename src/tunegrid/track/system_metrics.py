"""CPU/GPU utilization and memory of a cell's run, sampled by MLflow's own system-metrics monitor.

MLflow's monitor (psutil; the GPU through nvidia-ml-py where it is installed) runs as a thread of the
cell's supervisor, never of the training process, so a cell trains exactly as fast with it. Its series
are `system/*` metrics of the run. tunegrid's own peaks (`mem_peak_bytes`, result.json's `memory`) stay
the source of truth for memory: these are the host's view, sampled every `interval_s`.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class SystemMetrics:
    """MLflow's SystemMetricsMonitor on one run; a cell shorter than the interval still gets one sample."""

    def __init__(self, uri: str, run_id: str, interval_s: float) -> None:
        self.monitor: Any = None
        if interval_s <= 0:
            return
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self.monitor = SystemMetricsMonitor(run_id, sampling_interval=interval_s, tracking_uri=uri)
            self.monitor.start()
        except Exception as exc:  # a view of the host, never a reason to fail a cell
            log.warning("system metrics not monitored: %s", exc)
            self.monitor = None

    def stop(self) -> int:
        """Stop sampling (before the run is terminated); returns the samples the run got."""
        monitor, self.monitor = self.monitor, None
        if monitor is None:
            return 0
        try:
            monitor.finish()
            if monitor._logging_step == 0:  # the cell ended within one interval: log what is there now
                monitor.collect_metrics()
                monitor.publish_metrics(monitor.aggregate_metrics())
                monitor.mlflow_logger.flush()
            return int(monitor._logging_step)
        except Exception as exc:
            log.warning("system metrics not logged: %s", exc)
            return 0
