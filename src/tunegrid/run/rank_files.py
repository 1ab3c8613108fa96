"""What each rank of a running or ended cell leaves in its folder, read as one record: its facts (worker.json),
heartbeat, exit, local time per step and, on NCCL, the watchdog's line in its log. The supervisor's readings
(tunegrid.run.rank_diagnosis after the ranks ended, tunegrid.run.hang_watch while they run) start here.
Standard library only.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Any

from tunegrid.run.throughput import metric_records
from tunegrid.runtime.files import read_json
from tunegrid.runtime.rundir import rank_dir

STEP_RE = re.compile(r"step (\d+)")
# What ProcessGroupNCCL's watchdog logs (to the rank's stderr, its log here) before it takes the process down
# with SIGABRT: on NCCL a collective timeout never reaches Python as an exception, so no worker.json says so.
NCCL_WATCHDOG_RE = re.compile(
    r"Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(?P<seq>\d+), OpType=(?P<op>\w+)"
)


def _tail(path: Path, lines: int = 15) -> list[str]:
    if not path.exists():
        return []
    return path.read_text(errors="replace").splitlines()[-lines:]


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def nccl_watchdog_timeout(log_path: Path) -> dict[str, Any] | None:
    """The NCCL watchdog's timeout line in a rank's log: the collective it waited in and its sequence number."""
    if not log_path.exists():
        return None
    for line in log_path.read_text(errors="replace").splitlines():
        found = NCCL_WATCHDOG_RE.search(line)
        if found:
            return {"op": found["op"], "seq": int(found["seq"]), "message": line.strip()[:400]}
    return None


def rank_record(run_dir: Path, rank: int, code: int | None, stopped: bool) -> dict[str, Any]:
    folder = rank_dir(run_dir, rank)
    facts_path = folder / "worker.json"
    facts = read_json(facts_path) if facts_path.exists() else {}
    beat_path = folder / "heartbeat"
    heartbeat = beat_path.read_text().strip() if beat_path.exists() else ""
    step = STEP_RE.search(heartbeat)
    diagnosis = facts.get("diagnosis") or {}
    watchdog = nccl_watchdog_timeout(run_dir / "ranks" / f"rank{rank}.log") if not stopped else None
    if watchdog is not None and "collective_timeout" not in diagnosis:
        # the rank died (SIGABRT) in the NCCL watchdog before it could write its facts: a waiting rank
        diagnosis = {"collective_timeout": {"rank": rank, "waiting_in": heartbeat, **watchdog}}
    return {
        "rank": rank,
        "exit_code": code,
        "exit": _exit_text(code),
        "stopped_by_supervisor": stopped,
        "outcome": facts.get("outcome"),
        "reason": facts.get("reason"),
        "last_heartbeat": heartbeat,
        "last_step": int(step.group(1)) if step else None,
        "lora_sha256": facts.get("lora_sha256"),
        "diagnosis": diagnosis,
        "traceback": facts.get("traceback"),
        "log_tail": _tail(run_dir / "ranks" / f"rank{rank}.log"),
        "last_heartbeat_at": beat_path.stat().st_mtime if beat_path.exists() else None,
        "local_times": local_times(folder / "metrics.jsonl"),
    }


def local_times(metrics_path: Path) -> dict[int, float]:
    """step -> the rank's local time (metrics.jsonl's local_time_s; absent in runs from before it was written)."""
    return {int(r["step"]): float(r["local_time_s"]) for r in metric_records(metrics_path) if "local_time_s" in r}
