"""One row per cell, built with pandas from the result files: what a reviewer filters and sorts on."""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tunegrid.outcome import CellResult, module_name, origin_label
from tunegrid.review.quality import default_review, quality_columns, trained_curve
from tunegrid.runtime.files import read_json, read_jsonl
from tunegrid.study.grid_axes import SETTING_AXES
from tunegrid.targets import modelled_step_s as target_step_s
from tunegrid.vocabulary import axis_names, with_neutrals


def summary_row(record: dict[str, Any] | CellResult) -> dict[str, Any]:
    """A cell's row, from its result (a CellResult, or result.json as written by any version)."""
    result = record if isinstance(record, CellResult) else CellResult.from_json(record)
    # results written before an axis existed ran at its neutral value, or at the study setting it stands for
    cell = result.cell
    settings = {axis: (cell.get(section) or {}).get(key) for axis, (section, key) in SETTING_AXES.items()}
    # the axes that stand for a setting read as trained: the cell's own train/distributed values
    recorded = {**with_neutrals(result.axes), **{k: v for k, v in settings.items() if v is not None}}
    axes = {name: recorded.get(name) for name in axis_names()}
    diagnosis = result.diagnosis
    nan, oom, collective, crash = diagnosis.nan, diagnosis.oom, diagnosis.collective, diagnosis.rank_crash
    memory = result.memory
    training = result.training
    throughput = result.throughput
    in_effect = result.precision_in_effect
    audit = result.quant_audit
    final = audit.get("after_adapters") or {}
    loaded = audit.get("after_load") or {}
    return {
        "cell_id": result.cell_id,
        **axes,
        # sequences per optimizer step: micro-batch x accumulation x ranks
        "effective_batch": axes["batch_size"] * axes["grad_accum"] * axes["world_size"],
        "outcome": str(result.outcome),
        "reason": result.reason,
        "steps_run": training.get("steps_run"),
        "resumed_from_step": result.resumed_from_step,
        "initial_loss": training.get("initial_loss"),
        "final_loss": training.get("final_loss"),
        "skipped_steps": training.get("skipped_steps"),
        "updates_applied": training.get("updates_applied"),
        "loss_scale_end": training.get("loss_scale_end"),  # fp16: the GradScaler's scale after the last step
        "nan_step": nan.step if nan else None,
        "nan_kind": nan.kind if nan else None,
        "nan_forward_module": origin_label(nan.forward_origin) if nan else None,
        "nan_backward_module": origin_label(nan.backward_origin) if nan else None,
        "target": memory.get("target"),
        "budget_bytes": memory.get("budget_bytes"),
        "estimate_bytes": memory.get("estimate_bytes"),
        "estimate_over_measured": memory.get("estimate_over_measured"),
        "estimate_worker": memory.get("estimate_worker"),  # spawned / forked: the path the cell's worker took
        "cpu_onednn_off": bool(memory.get("cpu_onednn_off")),  # CPU MoE, bf16 (fp16 where oneDNN runs it): oneDNN off
        "peak_bytes": memory.get("peak_bytes"),
        "load_peak_bytes": memory.get("load_peak_bytes"),
        "first_step_peak_bytes": memory.get("first_step_peak_bytes"),
        "steady_peak_bytes": memory.get("steady_peak_bytes"),
        "optimizer_state_bytes": result.optimizer.get("state_bytes"),
        "optimizer_state_estimate_bytes": (memory.get("estimate_components") or {}).get("optimizer_state"),
        "oom_stage": oom.stage if oom else None,
        "oom_peak_bytes": oom.peak_bytes if oom else None,
        "tokens_per_s": throughput.get("tokens_per_s_median"),
        "step_time_s": throughput.get("step_time_s_median"),
        "modelled_step_s": modelled_step_s(result, str(axes["precision"]), bool(axes["activation_checkpointing"])),
        "weight_bytes_loaded": loaded.get("total_bytes"),
        "weight_bytes": final.get("total_bytes"),
        "expert_bytes": (final.get("by_role") or {}).get("experts"),
        "flagged_bytes": final.get("flagged_bytes"),
        "flagged_share": final.get("flagged_share"),
        "flagged_tensors": len(final["flagged"]) if final else None,
        "lora_unmatched": ",".join((audit.get("lora") or {}).get("unmatched", [])) or None,
        "fp32_islands": ",".join(m["module"] for m in (result.fp32_islands or {}).get("modules", [])) or None,
        "fp32_islands_max_ratio": max(
            (m["ratio_to_fp16_max"] or 0 for m in (result.fp32_islands or {}).get("modules", [])), default=None
        ),
        "fp16_headroom_worst_module": module_name(_worst_headroom(result).get("module") or "") or None,
        "fp16_headroom_worst_where": _worst_headroom(result).get("where"),
        "fp16_headroom_worst_ratio": _worst_headroom(result).get("ratio_to_fp16_max"),
        "forward_dtypes": ",".join(sorted((in_effect.get("forward") or {}).keys())),
        "collective_op": collective.op if collective else None,
        "collective_missing_ranks": ",".join(map(str, collective.missing_ranks)) or None if collective else None,
        "collective_diagnosis": collective.kind if collective else None,
        "collective_step": collective.step if collective else None,
        "collective_seq": collective.seq if collective else None,
        "collective_last_steps": json.dumps(collective.last_step_per_rank) if collective else None,
        # seconds from the last progress to the hang named while the ranks still ran (none: not named early)
        "collective_named_after_s": (collective.early or {}).get("quiet_for_s") if collective else None,
        **_straggler_columns(result),
        "crashed_ranks": ",".join(map(str, crash.ranks)) or None if crash else None,
        "attempts": len(result.attempts or [None]),
        "wall_s": result.wall_s,
        "stack_packages": stack_packages(result.env),
        "mlflow_run_id": (result.tracking or {}).get("run_id"),
    }


# Column types, decided once: a numeric column is float64 whatever a cell wrote ("inf" the string, inf
# the float, a missing value), so one odd cell cannot make pyarrow refuse the whole table.
NUMERIC_COLUMNS = (
    "initial_loss",
    "final_loss",
    "budget_bytes",
    "estimate_bytes",
    "estimate_over_measured",
    "peak_bytes",
    "load_peak_bytes",
    "first_step_peak_bytes",
    "steady_peak_bytes",
    "oom_peak_bytes",
    "optimizer_state_bytes",
    "optimizer_state_estimate_bytes",
    "tokens_per_s",
    "step_time_s",
    "step_time_noise",
    "modelled_step_s",
    "weight_bytes_loaded",
    "weight_bytes",
    "expert_bytes",
    "flagged_bytes",
    "flagged_share",
    "fp16_headroom_worst_ratio",
    "fp32_islands_max_ratio",
    "loss_scale_end",
    "loss_fall",
    "loss_deviation",
    "collective_timeout_s",
    "collective_named_after_s",
    "straggler_ratio",
    "wall_s",
)
INTEGER_COLUMNS = (
    "effective_batch",
    "steps_run",
    "resumed_from_step",
    "skipped_steps",
    "updates_applied",
    "nan_step",
    "flagged_tensors",
    "collective_step",
    "collective_seq",
    "straggler_rank",
    "attempts",
)


def typed(frame: Any) -> Any:
    """Numbers as numbers (inf stays inf, missing is NaN); every other column is text or null."""
    import pandas as pd

    for column in frame.columns:
        if column in NUMERIC_COLUMNS:
            frame[column] = pd.to_numeric(frame[column], errors="coerce").astype("float64")
        elif column in INTEGER_COLUMNS:
            # int64 when every cell has one, else float64 with NaN (what the report's arithmetic expects)
            frame[column] = pd.to_numeric(frame[column], errors="coerce")
        elif frame[column].dtype == object:
            values = frame[column].map(lambda v: None if v is None or (isinstance(v, float) and v != v) else v)
            if len({type(v) for v in values if v is not None}) > 1:  # mixed kinds: one text column
                values = values.map(lambda v: None if v is None else str(v))
            frame[column] = values
    return frame


def modelled_step_s(result: CellResult, precision: str, checkpointing: bool) -> float | None:
    """The cell's step time on its named target as the data sheet models it (tunegrid.targets.modelled_step), from
    the FLOPs and the memory estimate its plan recorded and the bytes its fp32 islands grew by; None on the machine
    itself (its cells are measured), or where the plan holds neither."""
    plan = result.cell.get("plan") or {}
    flops = (plan.get("liveness") or {}).get("step_flops")
    components = (plan.get("estimate") or {}).get("components")
    widened = int((result.fp32_islands or {}).get("weights_widened_bytes") or 0)
    return target_step_s(plan.get("target"), precision, flops, components, widened, checkpointing=checkpointing)


def stack_packages(env: dict[str, Any]) -> str | None:
    """What a cell's library stack pinned, as resolved (`transformers==4.57.6`); None on the base stack."""
    stack = env.get("stack") or {}
    versions = stack.get("versions") or {}
    pins = stack.get("pins") or {}
    return " ".join(f"{name}=={versions.get(name) or pins[name]}" for name in sorted(pins)) or None


def _straggler_columns(result: CellResult) -> dict[str, Any]:
    """The straggler a timeout was blamed on, else the early warning of a cell that did not time out."""
    collective = result.diagnosis.collective
    straggler = (collective.straggler if collective else None) or result.distributed.get("straggler") or {}
    return {
        "straggler_rank": straggler.get("rank"),
        "straggler_ratio": straggler.get("median_ratio"),
        "collective_parted": (
            f"rank(s) {','.join(map(str, collective.parted_ranks))} at step {collective.parted_at_step}"
            if collective and collective.parted_ranks
            else None
        ),
    }


def _worst_headroom(result: CellResult) -> dict[str, Any]:
    worst = result.fp16_headroom.get("worst_modules") or [{}]
    return worst[0]


def step_time_noise(metric_lines: list[dict[str, Any]]) -> float | None:
    """How far a cell's measured speed may be from its median by chance: the median absolute deviation of its step
    times after the first (whose time includes the warm-up), relative to their median. Robust as the median
    throughput it qualifies is: one step slowed by another job on the host moves neither. Two fixes whose
    throughput differs by less than this are equally fast as measured (review/precision_advice.py). None with
    fewer than two such steps."""
    times = [float(line["step_time_s"]) for line in metric_lines[1:] if line.get("step_time_s")]
    if len(times) < 2:
        return None
    middle = statistics.median(times)
    return statistics.median(abs(t - middle) for t in times) / middle if middle > 0 else None


def build_summary(
    result_paths: Iterable[str | Path], sync_path: str | Path | None = None, review: dict[str, Any] | None = None
) -> Any:
    """One row per cell, with its quality columns (review/quality.py) read from each cell's metrics.jsonl."""
    import pandas as pd

    synced = read_json(sync_path) if sync_path else {}
    rows, curves, skipped = [], {}, {}
    for path in result_paths:
        row = summary_row(read_json(path))
        row["mlflow_run_id"] = (synced.get(row["cell_id"]) or {}).get("run_id") or row["mlflow_run_id"]
        metrics = Path(path).parent / "metrics.jsonl"
        # the losses after each update: steps the GradScaler skipped are left out (review/quality.py)
        lines = read_jsonl(metrics) if metrics.exists() else []
        curves[row["cell_id"]], skipped[row["cell_id"]] = trained_curve(lines)
        row["step_time_noise"] = step_time_noise(lines)
        rows.append(row)
    judged = quality_columns(rows, curves, review or default_review(), skipped)
    for row, quality in zip(rows, judged, strict=True):
        row.update(quality)
    return typed(pd.DataFrame(rows))


def write_summary(
    result_paths: Iterable[str | Path],
    csv_path: str | Path,
    sync_path: str | Path | None = None,
    review: dict[str, Any] | None = None,
) -> Any:
    from tunegrid.runtime.files import atomic_write_text

    frame = build_summary(result_paths, sync_path, review)
    atomic_write_text(csv_path, frame.to_csv(index=False))
    # Parquet keeps types, and keeps the outcome "nan" a string (pandas' read_csv turns it into NaN
    # unless called with keep_default_na=False).
    parquet = Path(csv_path).with_suffix(".parquet")
    tmp = parquet.with_name(f".{parquet.name}.tmp")
    frame.to_parquet(tmp, index=False)
    tmp.replace(parquet)
    return frame
