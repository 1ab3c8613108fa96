"""A cell's result.json, composed from what its worker wrote (worker.json) or, where the worker could not
say, from how it ended (a signal, an exit code, a supervisor verdict such as a timeout).
"""

from __future__ import annotations

import shlex
import signal
import time
from pathlib import Path
from typing import Any

from tunegrid.files import read_json
from tunegrid.rundir import heartbeat_stage
from tunegrid.vocabulary import Outcome


def origin_label(fact: dict[str, Any] | None) -> str | None:
    """A traced non-finite origin's module, marked when no real token position of it was non-finite (its
    `at`: padding, or unlocated for a tensor without positions); one label for summary.csv and run tags."""
    if not fact:
        return None
    return f"{fact['module']} ({fact['at']})" if fact.get("at") in ("padding", "unlocated") else fact["module"]


def infrastructure_fault(result: dict[str, Any]) -> bool:
    """A process that died without writing its facts (signal, lost rank): not a property of the cell's
    settings, so worth one more attempt. Exceptions the worker caught and classified are not retried."""
    if result["outcome"] != Outcome.ERROR or (result.get("diagnosis") or {}).get("rank_failure"):
        return False  # a rank that reported its own error fails the same way again
    if (result.get("diagnosis") or {}).get("rank_crash"):
        return True
    return result.get("worker_exit_code") not in (0, None) and not (
        result.get("training") or result.get("precision_plan")
    )


def compose_result(
    spec: dict[str, Any],
    run_dir: Path,
    returncode: int | None,
    verdict: tuple[str, str] | None,
    started: float,
    command: list[str],
    env: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """result.json for one attempt; `env` is the supervisor's light environment record."""
    worker_path = run_dir / "worker.json"
    facts: dict[str, Any] = read_json(worker_path) if worker_path.exists() else {}
    if verdict is not None:  # decided by the supervisor: infeasible before training, or a timeout
        outcome, reason = verdict
        if outcome == Outcome.TIMEOUT:
            facts["diagnosis"] = {
                "timeout": {
                    "stage": facts.get("stage") or heartbeat_stage(run_dir),
                    "limit_s": spec["train"]["time_limit_s"],
                    "heartbeat_timeout_s": spec["train"]["heartbeat_timeout_s"],
                }
            }
    elif facts:
        outcome, reason = facts["outcome"], facts["reason"]
    else:
        signame = signal.Signals(-returncode).name if returncode is not None and returncode < 0 else None
        outcome = Outcome.ERROR
        reason = (
            f"worker killed by {signame}" + (" (the kernel's OOM killer sends SIGKILL)" if signame == "SIGKILL" else "")
            if signame
            else f"worker exited with code {returncode} before writing its facts"
        )
    env = dict(env or {})
    env["device"] = (facts.get("precision_plan") or {}).get("device_type", "")
    return {
        "cell_id": spec["cell_id"],
        "cell": spec,
        "env": env,
        "outcome": outcome,
        "reason": reason,
        "diagnosis": facts.get("diagnosis", {}),
        "memory": _memory(spec, facts.get("memory", {})),
        "precision_in_effect": facts.get("precision_in_effect", {}),
        "precision_plan": facts.get("precision_plan", {}),
        "throughput": facts.get("throughput", {}),
        "data": facts.get("data", {}),
        "fp16_headroom": facts.get("fp16_headroom", {}),
        "fp32_islands": facts.get("fp32_islands"),  # fp16-islands: the modules kept in fp32 and their maxima
        "quant_audit": facts.get("quant_audit", {}),
        "training": facts.get("training", {}),
        "resumed_from_step": facts.get("resumed_from_step"),
        "checkpoint": facts.get("checkpoint", {}),
        "adapter": facts.get("adapter"),
        "params": facts.get("params", {}),
        "traceback": facts.get("traceback"),
        "worker_exit_code": returncode,
        "wall_s": time.time() - started,
        "started_at": started,  # epoch seconds: the cell's MLflow run spans exactly these
        "ended_at": time.time(),
        "command": shlex.join(command),
    }


def _memory(spec: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """Measured peaks by stage beside the estimate made before training (the tracker's accuracy)."""
    plan = spec["plan"]
    memory = {
        **measured,
        "estimate_bytes": plan["estimate"]["estimate_bytes"],
        "estimate_components": plan["estimate"]["components"],
        "budget_bytes": plan["budget_bytes"],
        "target": plan["target"],
    }
    peak = measured.get("peak_bytes")
    memory["estimate_over_measured"] = plan["estimate"]["estimate_bytes"] / peak if peak else None
    return memory
