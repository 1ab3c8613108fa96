"""What happened to a multi-process cell: per-rank facts, exit codes and heartbeats -> one outcome.

Precedence: a rank that died by itself (signal or non-zero exit the supervisor did not cause) is the
cause, whatever its peers reported afterwards (`error`); then a collective timeout (`timeout`: the
ranks that reported it waited, the others never arrived); otherwise rank 0's outcome, checked against
the other ranks (their LoRA weights must be bit-identical after DDP).

The supervisor's reading, after the ranks ended, of the files they leave (no torch; PyTorch's flight-recorder
reader runs in a process of its own: tunegrid.run.recorder_read).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from tunegrid.cell_spec import CellSpec, DistributedSpec
from tunegrid.diagnosis import CollectiveDiagnosis, Diagnosis, RankCrash, RecorderReading
from tunegrid.run.collective import classify_timeout, describe, find_straggler
from tunegrid.run.hang_watch import EarlyVerdict, compared, ended_on_hang
from tunegrid.run.rank_files import rank_record
from tunegrid.run.recorder_read import STATUSES, dump_files
from tunegrid.run.throughput import cell_throughput, step_records
from tunegrid.runtime.rundir import rank_dir
from tunegrid.vocabulary import Outcome

STEP_RE = re.compile(r"step (\d+)")


def _collective_op(waiting: dict[str, Any]) -> str:
    waiting_in = waiting["waiting_in"]
    if waiting.get("op"):  # named by the NCCL watchdog itself
        return str(waiting["op"])
    if "all-reduce" in waiting_in:
        return "ALLREDUCE"
    if "init_process_group" in waiting_in or "ddp" in waiting_in:
        return "BROADCAST/BARRIER (process-group or DDP setup)"
    return "unknown"


def analyze_flight_recorder(run_dir: Path, spec: CellSpec, world: int) -> RecorderReading | None:
    """On NCCL timeouts PyTorch dumps each rank's ring buffer; tunegrid.run.recorder_read reads them with the cell's
    Python, in a process of its own (PyTorch's reader imports torch), into one typed reading. None when the cell
    keeps no flight_recorder folder; a reader that crashes, hangs or prints nothing is a `failed` reading."""
    from tunegrid.run.launch import child_env

    folder = run_dir / "flight_recorder"
    if not folder.is_dir():
        return None
    if not dump_files(folder)[0]:  # a gloo cell's (CPU), or a timeout no rank dumped for: nothing to start a reader on
        return RecorderReading.from_json({"status": "no_dumps", "note": f"no dump file in {folder}"})
    python = spec.stack.python if spec.stack is not None else ""  # "": the base stack, this interpreter
    command = [python or sys.executable, "-m", "tunegrid.run.recorder_read", str(folder)]
    try:
        proc = subprocess.run(
            [*command, "--world", str(world)], capture_output=True, text=True, timeout=180, env=child_env()
        )
        raw = json.loads(proc.stdout) if proc.stdout.strip() else None
        if not isinstance(raw, dict) or raw.get("status") not in STATUSES:
            tail = " | ".join(line for line in (proc.stderr or "").splitlines()[-3:] if line.strip())
            why = "no output" if raw is None else "an answer without a known status"
            raw = {"status": "failed", "note": f"the reader gave {why} (exit {proc.returncode}): {tail}"[:400]}
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        raw = {"status": "failed", "note": f"the reader did not run: {type(exc).__name__}: {exc}"[:400]}
    return RecorderReading.from_json(raw)


def _worth_a_line(recorder: RecorderReading | None, kind: dict[str, Any]) -> bool:
    """The reading's own sentence in the reason: not for a folder without dumps, nor when it decided (describe)."""
    return recorder is not None and recorder.status != "no_dumps" and kind.get("evidence") != "flight_recorder"


def _on_the_main_path(
    collective: CollectiveDiagnosis, kind: dict[str, Any], ranks: list[dict[str, Any]], waiting: list[dict[str, Any]]
) -> tuple[CollectiveDiagnosis, list[dict[str, Any]]]:
    """For a mismatch, the collective, step and missing ranks as the main path sees them: whichever rank gave
    up first, the ranks that parted are the ones that never arrive at the collective the others wait in."""
    if kind["kind"] != "mismatch" or kind["evidence"] != "collectives":
        return collective, waiting
    main = kind["main_path"]
    op = "BARRIER" if main["collective"] == "barrier" else "ALLREDUCE"
    waiting = [r for r in ranks if r["rank"] not in kind["parted_ranks"]]
    on_main = collective.replace(
        op=op, step=main["step"], missing_ranks=kind["parted_ranks"], waiting_ranks=[r["rank"] for r in waiting]
    )
    return on_main, waiting


def _slow_link(
    run_dir: Path, ranks: list[dict[str, Any]], result: dict[str, Any], capabilities: dict[str, Any], min_lag_s: float
) -> dict[str, Any] | None:
    from tunegrid.run.link_check import GRAD_BYTES_PER_PARAM, find_slow_link, predicted_allreduce

    trainable = int((result.get("params") or {}).get("trainable") or 0)
    predicted = predicted_allreduce(capabilities, len(ranks), trainable * GRAD_BYTES_PER_PARAM)
    walls = {r["rank"]: step_records(rank_dir(run_dir, r["rank"]) / "metrics.jsonl") for r in ranks}
    step_times = {rank: {step: seconds for step, (_, seconds) in timed.items()} for rank, timed in walls.items()}
    found = find_slow_link({r["rank"]: r["local_times"] for r in ranks}, step_times, predicted, min_lag_s)
    return None if found is None else {**found, "gradient_bytes": trainable * GRAD_BYTES_PER_PARAM}


def diagnose_ranks(
    spec: CellSpec,
    run_dir: Path,
    result: dict[str, Any],
    codes: list[int | None],
    stopped: list[int],
    early: EarlyVerdict | None = None,
    capabilities: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Fields of result.json for a distributed cell: outcome, reason, diagnosis, ranks. `early`: the hang the
    supervisor named while the ranks ran (tunegrid.run.hang_watch), compared with the timeout's verdict, or the
    verdict itself where the study ends a cell on a named hang. `capabilities`: the probe's, whose all-reduce bus
    bandwidth tells a slow link."""
    world = len(codes)
    ranks = [rank_record(run_dir, r, codes[r], r in stopped) for r in range(world)]
    update = _cell_facts(spec, run_dir, result, ranks)
    recorder = analyze_flight_recorder(run_dir, spec, world)
    if recorder is not None and recorder.status != "no_dumps":
        update["distributed"]["flight_recorder"] = recorder.record
    # the precedence of the module's docstring: the first of these that names a cause decides the cell
    decided = _rank_crash(ranks) or _rank_failure(ranks) or _collective_timeout(spec, ranks, recorder, early)
    if decided is not None:
        update.update(decided)
        return update
    update["distributed"].update(_early_warning(run_dir, ranks, result, capabilities or {}, spec.distributed))
    if "stopped_by_peer" in (result.get("diagnosis") or {}):  # rank 0 stopped because another rank decided to
        update.update(_decided_by_peer(ranks))
    elif result["outcome"] == Outcome.OK:
        digests = {r["lora_sha256"] for r in ranks}
        update["distributed"]["lora_identical"] = len(digests) == 1 and None not in digests
        if not update["distributed"]["lora_identical"]:
            update.update(
                outcome=Outcome.ERROR, reason="ranks ended with different LoRA weights (DDP did not keep them in sync)"
            )
    return update


def _cell_facts(spec: CellSpec, run_dir: Path, result: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """What result.json says of every distributed cell, whatever its outcome: the ranks, the world, throughput."""
    settings = {"world_size": len(ranks), "collective_timeout_s": spec.distributed.collective_timeout_s}
    update: dict[str, Any] = {"ranks": ranks, "distributed": settings}
    throughput = cell_throughput({r: step_records(rank_dir(run_dir, r) / "metrics.jsonl") for r in range(len(ranks))})
    if throughput:  # rank 0's own figure (what its worker wrote) is one of the per-rank ones
        update["throughput"] = {**(result.get("throughput") or {}), **throughput}
    return update


def _on_its_own(rank: dict[str, Any]) -> bool:
    """Whether what the rank reported is its own, not a symptom of a peer: a rank that left after noticing its peer
    was gone (gloo/NCCL "connection closed by peer"), or that waited for one, is a consequence."""
    return not {"peer_lost", "collective_timeout"} & set(rank["diagnosis"])


def _last_steps(ranks: list[dict[str, Any]]) -> dict[int, int | None]:
    return {r["rank"]: r["last_step"] for r in ranks}


def _rank_crash(ranks: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A rank that died by itself (signal or non-zero exit the supervisor did not cause). A consequence is no crash,
    whether it exits before the supervisor stops it being only timing."""
    crashed = [
        r for r in ranks if not r["stopped_by_supervisor"] and r["exit_code"] not in (0, None) and _on_its_own(r)
    ]
    if not crashed:
        return None
    first = crashed[0]
    at = (
        f" at step {first['last_step']}"
        if first["last_step"] is not None
        else f" during {first['last_heartbeat'] or 'start-up'}"
    )
    crash = RankCrash(
        ranks=[r["rank"] for r in crashed],
        exit=first["exit"],
        last_step=first["last_step"],
        last_log_lines=first["log_tail"],
        last_step_per_rank=_last_steps(ranks),
    )
    return {
        "outcome": Outcome.ERROR,
        "reason": f"rank {first['rank']} died ({first['exit']}){at}; the other ranks were stopped",
        "diagnosis": Diagnosis(rank_crash=crash).to_json(),
    }


def _rank_failure(ranks: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A rank whose worker.json says error/oom of its own: its peers then wait or are stopped. Deterministic, so
    the cell is never retried for it."""
    failed = [r for r in ranks if r["outcome"] in (Outcome.ERROR, Outcome.OOM) and _on_its_own(r)]
    if not failed:
        return None
    first = failed[0]
    failure = {
        "ranks": [r["rank"] for r in failed],
        "reason": first["reason"],
        "traceback": (first["traceback"] or "")[-2000:],
        "last_log_lines": first["log_tail"],
        "last_step_per_rank": _last_steps(ranks),
    }
    return {
        "outcome": first["outcome"],
        "reason": f"rank {first['rank']} failed: {first['reason']}; the other ranks were stopped",
        "diagnosis": {"rank_failure": failure},
    }


def _collective_timeout(
    spec: CellSpec, ranks: list[dict[str, Any]], recorder: RecorderReading | None, early: EarlyVerdict | None
) -> dict[str, Any] | None:
    """The ranks that reported a collective timeout waited, the others never arrived; or, where the study ends a
    cell on a named hang and no rank has timed out yet, the hang named while the ranks ran."""
    timeout_s = spec.distributed.collective_timeout_s
    waiting = [r for r in ranks if "collective_timeout" in r["diagnosis"]]
    if early is not None and not waiting and spec.distributed.end_on_hang:
        return {
            "outcome": Outcome.TIMEOUT,
            "reason": early.reason(timeout_s),
            "diagnosis": Diagnosis(collective=ended_on_hang(early, ranks, timeout_s)).to_json(),
        }
    if not waiting:
        return None
    collective, waiting, kind = _timed_out_collective(spec.distributed, ranks, waiting, recorder)
    if early is not None:
        collective = collective.replace(early=compared(early, collective.kind, collective.missing_ranks))
    who = ", ".join(map(str, collective.missing_ranks)) or "none identified"
    reason = (
        f"collective timeout after {timeout_s:g} s in {collective.op}"
        + (f" at step {collective.step}" if collective.step is not None else "")
        + f": rank(s) {who} did not arrive; rank(s) {', '.join(str(r['rank']) for r in waiting)} waited"
        + f"; {describe(kind)}"
        + (f"; {recorder.line()}" if _worth_a_line(recorder, kind) else "")
    )
    return {"outcome": Outcome.TIMEOUT, "reason": reason, "diagnosis": Diagnosis(collective=collective).to_json()}


def _timed_out_collective(
    settings: DistributedSpec,
    ranks: list[dict[str, Any]],
    waiting: list[dict[str, Any]],
    recorder: RecorderReading | None,
) -> tuple[CollectiveDiagnosis, list[dict[str, Any]], dict[str, Any]]:
    """The collective the waiting ranks gave up in, who did not arrive and the kind of hang (classify_timeout's),
    with the ranks that waited in it."""
    waited = waiting[0]["diagnosis"]["collective_timeout"]
    missing = [r["rank"] for r in ranks if r not in waiting]
    # every rank logged the watchdog's line (each waited, on NCCL): the recorder names who did not arrive
    missing_from = "logs" if missing or recorder is None or not recorder.suspect_ranks else "flight_recorder"
    missing = missing or (recorder.suspect_ranks if recorder is not None else [])
    waiting = [r for r in waiting if r["rank"] not in missing] or waiting
    found = STEP_RE.search(waited["waiting_in"])
    step = int(found.group(1)) if found else None
    timeout_s, factor, min_lag_s = (
        settings.collective_timeout_s,
        settings.straggler_factor,
        settings.straggler_min_lag_s,
    )
    kind = classify_timeout(ranks, missing, step, timeout_s, factor, recorder, min_lag_s)
    collective = CollectiveDiagnosis(
        op=_collective_op(waited),
        waiting_ranks=[r["rank"] for r in waiting],
        missing_ranks=missing,
        missing_from=missing_from,
        timeout_s=timeout_s,
        step=step,
        seq=waited.get("seq"),  # NCCL's watchdog names it; gloo does not report one
        last_step_per_rank=_last_steps(ranks),
        last_heartbeat_per_rank={r["rank"]: r["last_heartbeat"] for r in ranks},
        message=waited["message"],
        flight_recorder=recorder,
        kind=kind["kind"],
        evidence=kind,
    )
    collective, waiting = _on_the_main_path(collective, kind, ranks, waiting)
    return collective, waiting, kind


def _early_warning(
    run_dir: Path,
    ranks: list[dict[str, Any]],
    result: dict[str, Any],
    capabilities: dict[str, Any],
    settings: DistributedSpec,
) -> dict[str, Any]:
    """For a cell no rank stopped: a straggler slow on most steps, not (yet) slow enough to time out, or, with
    every rank at pace, collectives slower than the probe's link (tunegrid.run.link_check)."""
    warning = find_straggler(
        {r["rank"]: r["local_times"] for r in ranks},
        settings.straggler_factor,
        settings.straggler_min_lag_s,
    )
    if warning is not None:
        return {"straggler": warning}
    link = _slow_link(run_dir, ranks, result, capabilities, settings.straggler_min_lag_s)
    return {} if link is None else {"slow_link": link}


def _decided_by_peer(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The outcome of the rank whose decision the others stopped with; nothing where none says it decided."""
    decider = next((r for r in ranks if r["outcome"] and "stopped_by_peer" not in r["diagnosis"]), None)
    if decider is None:
        return {}
    return {
        "outcome": decider["outcome"],
        "reason": f"rank {decider['rank']}: {decider['reason']}; the other ranks stopped with it",
        "diagnosis": {**decider["diagnosis"], "decided_by_rank": decider["rank"]},
    }
