"""The one table of what a cell's result shows: each row one fact of result.json, with the summary.csv column it
fills, the MLflow tag it is and the report's label for it, so summary.csv's row (review/summary.py), a run's tags
(track/tags.py) and the report's audit table (review/report.py) are all made from it. Adding a fact is one row.

A row's summary value is None where the cell has no such fact. Its tag is that value as text unless the row says
otherwise (`tag_text`), and is not set where the text is None. Outside the table: cell_id and the axes (the axis
table, tunegrid.vocabulary) before the columns, the columns read from metrics.jsonl after them (QUALITY_SOURCED),
and the tags listed in TAGS_OUTSIDE.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from tunegrid.cell_view import (
    CellView,
    collective_of,
    crash_of,
    flagged_names,
    link_of,
    memory_of,
    modelled_step_s,
    nan_of,
    oom_of,
    ratio_text,
    stack_packages,
)
from tunegrid.outcome import module_name, origin_label
from tunegrid.units import human_bytes

Getter = Callable[[CellView], Any]


@dataclass(frozen=True)
class Column:
    """One fact: `name` its summary.csv column (None: a tag only), `value` its summary value, `tag` its MLflow tag
    (None: none), `tag_text` the tag's text where it is not str(value) (None: no tag on this run), `label` its
    header in the report's audit table with `shown` the text there where it is not the value, `dtype` how the
    summary types it (review/summary.py's typed)."""

    name: str | None
    value: Getter
    tag: str | None = None
    tag_text: Getter | None = None
    label: str | None = None
    shown: Getter | None = None
    dtype: Literal["float", "int"] | None = None

    def tag_of(self, view: CellView) -> str | None:
        if self.tag_text is not None:
            return self.tag_text(view)
        value = self.value(view)
        return None if value is None else str(value)


def _joined(values: Any) -> str:
    return ",".join(map(str, values))


def _g(value: Any) -> str:
    return f"{value:g}"


def _if(part: Any, text: Getter) -> Getter:
    """A tag written where the result holds `part` (a getter), as `text` of the view."""
    return lambda v: text(v) if part(v) else None


_C = Column
COLUMNS: tuple[Column, ...] = (
    # sequences per optimizer step: micro-batch x accumulation x ranks (the tag is the axes', track/tags.py)
    _C("effective_batch", lambda v: v.axes["batch_size"] * v.axes["grad_accum"] * v.axes["world_size"], dtype="int"),
    _C("outcome", lambda v: str(v.result.outcome), "outcome", label="outcome"),
    _C(None, lambda v: v.result.env.get("device", ""), "device"),
    _C("reason", lambda v: v.result.reason, "outcome.reason"),
    _C("steps_run", lambda v: v.result.training.get("steps_run"), dtype="int"),
    _C("resumed_from_step", lambda v: v.result.resumed_from_step, "resumed_from_step", dtype="int"),
    _C("initial_loss", lambda v: v.result.training.get("initial_loss"), dtype="float"),
    _C("final_loss", lambda v: v.result.training.get("final_loss"), dtype="float"),
    _C("skipped_steps", lambda v: v.result.training.get("skipped_steps"), dtype="int"),
    _C("updates_applied", lambda v: v.result.training.get("updates_applied"), dtype="int"),
    # fp16: the GradScaler's scale after the last step
    _C("loss_scale_end", lambda v: v.result.training.get("loss_scale_end"), dtype="float"),
    _C("nan_step", lambda v: nan_of(v).step if nan_of(v) else None, "nan.step", dtype="int"),
    _C("nan_kind", lambda v: str(nan_of(v).kind) if nan_of(v) else None, "nan.kind"),
    _C(
        "nan_forward_module",
        lambda v: origin_label(nan_of(v).forward_origin) if nan_of(v) else None,
        "nan.forward_module",
        _if(nan_of, lambda v: origin_label(nan_of(v).forward_origin) or ""),
    ),
    _C(
        "nan_backward_module",
        lambda v: origin_label(nan_of(v).backward_origin) if nan_of(v) else None,
        "nan.backward_module",
        _if(nan_of, lambda v: origin_label(nan_of(v).backward_origin) or ""),
    ),
    _C("target", lambda v: memory_of(v, "target")),
    _C("budget_bytes", lambda v: memory_of(v, "budget_bytes"), dtype="float"),
    _C(
        "estimate_bytes",
        lambda v: memory_of(v, "estimate_bytes"),
        "memory.estimate_bytes",
        _if(lambda v: memory_of(v, "estimate_bytes"), lambda v: str(memory_of(v, "estimate_bytes"))),
        dtype="float",
    ),
    _C(
        "estimate_over_measured",
        lambda v: memory_of(v, "estimate_over_measured"),
        "memory.estimate_over_measured",
        _if(lambda v: memory_of(v, "estimate_bytes"), ratio_text),
        dtype="float",
    ),
    # spawned / forked: the path the cell's worker took
    _C(
        "estimate_worker",
        lambda v: memory_of(v, "estimate_worker"),
        "memory.estimate_worker",
        _if(lambda v: memory_of(v, "estimate_bytes"), lambda v: str(memory_of(v, "estimate_worker") or "")),
    ),
    # CPU MoE, bf16 (fp16 where oneDNN runs it): oneDNN off; the tag says why (prepare/cpu_kernels.py)
    _C(
        "cpu_onednn_off",
        lambda v: bool(memory_of(v, "cpu_onednn_off")),
        "kernels.cpu_onednn_off",
        _if(lambda v: memory_of(v, "cpu_onednn_off"), lambda v: str(memory_of(v, "cpu_onednn_off"))),
    ),
    _C("peak_bytes", lambda v: memory_of(v, "peak_bytes"), dtype="float"),
    _C("load_peak_bytes", lambda v: memory_of(v, "load_peak_bytes"), dtype="float"),
    _C("first_step_peak_bytes", lambda v: memory_of(v, "first_step_peak_bytes"), dtype="float"),
    _C("steady_peak_bytes", lambda v: memory_of(v, "steady_peak_bytes"), dtype="float"),
    _C(
        "optimizer_state_bytes", lambda v: v.result.optimizer.get("state_bytes"), "optimizer.state_bytes", dtype="float"
    ),
    _C(
        None,
        lambda v: v.result.optimizer.get("paging"),
        "optimizer.paging",
        _if(lambda v: v.result.optimizer.get("state_bytes") is not None, lambda v: v.result.optimizer["paging"]),
    ),
    _C(
        "optimizer_state_estimate_bytes",
        lambda v: (memory_of(v, "estimate_components") or {}).get("optimizer_state"),
        dtype="float",
    ),
    _C(
        "oom_stage",
        lambda v: oom_of(v).stage if oom_of(v) else None,
        "oom.stage",
        _if(oom_of, lambda v: str(oom_of(v).stage)),
    ),
    _C("oom_peak_bytes", lambda v: oom_of(v).peak_bytes if oom_of(v) else None, dtype="float"),
    _C("tokens_per_s", lambda v: v.result.throughput.get("tokens_per_s_median"), dtype="float"),
    _C("step_time_s", lambda v: v.result.throughput.get("step_time_s_median"), dtype="float"),
    _C(
        "modelled_step_s",
        lambda v: modelled_step_s(v.result, str(v.axes["precision"]), bool(v.axes["activation_checkpointing"])),
        dtype="float",
    ),
    _C(
        "weight_bytes_loaded",
        lambda v: (v.result.quant_audit.get("after_load") or {}).get("total_bytes"),
        dtype="float",
    ),
    _C(
        "weight_bytes",
        lambda v: v.final_audit.get("total_bytes"),
        "audit.weight_bytes",
        label="weight bytes",
        dtype="float",
    ),
    _C(
        None,
        lambda v: v.final_audit.get("by_dtype"),
        label="by dtype",
        shown=lambda v: ", ".join(
            f"{k}: {human_bytes(b)}" for k, b in sorted((v.final_audit.get("by_dtype") or {}).items())
        ),
    ),
    _C(
        "expert_bytes",
        lambda v: (v.final_audit.get("by_role") or {}).get("experts"),
        label="expert bytes",
        dtype="float",
    ),
    _C("flagged_bytes", lambda v: v.final_audit.get("flagged_bytes"), "audit.flagged_bytes", dtype="float"),
    _C(
        "flagged_share",
        lambda v: v.final_audit.get("flagged_share"),
        "audit.flagged_share",
        _if(lambda v: v.final_audit, lambda v: f"{v.final_audit['flagged_share']:.4f}"),
        label="flagged share",
        dtype="float",
    ),
    _C(
        "flagged_tensors",
        lambda v: len(v.final_audit["flagged"]) if v.final_audit else None,
        "audit.flagged_tensors",
        label="flagged tensors",
        shown=flagged_names,
        dtype="int",
    ),
    _C(
        "lora_unmatched",
        lambda v: ",".join((v.result.quant_audit.get("lora") or {}).get("unmatched", [])) or None,
        "lora.unmatched",
        _if(lambda v: v.final_audit, lambda v: ",".join(v.result.quant_audit["lora"]["unmatched"])),
    ),
    # fp16-islands: which modules computed in fp32, and what the calibration measured there
    _C(
        "fp32_islands",
        lambda v: ",".join(m["module"] for m in v.islands) or None,
        "fp32_islands",
        _if(lambda v: v.result.fp32_islands, lambda v: ",".join(m["module"] for m in v.islands) or "none"),
    ),
    _C(None, lambda v: (v.result.fp32_islands or {}).get("mode"), "fp32_islands.mode"),
    _C(
        None,
        lambda v: None,
        "fp32_islands.max_abs",
        _if(
            lambda v: v.result.fp32_islands,
            lambda v: ",".join(f"{m['max_abs']:.0f}" if m.get("max_abs") is not None else "" for m in v.islands),
        ),
    ),
    _C(
        "fp32_islands_max_ratio",
        lambda v: max((m["ratio_to_fp16_max"] or 0 for m in v.islands), default=None),
        dtype="float",
    ),
    _C("fp16_headroom_worst_module", lambda v: module_name(v.worst_headroom.get("module") or "") or None),
    _C("fp16_headroom_worst_where", lambda v: v.worst_headroom.get("where")),
    _C("fp16_headroom_worst_ratio", lambda v: v.worst_headroom.get("ratio_to_fp16_max"), dtype="float"),
    _C("forward_dtypes", lambda v: ",".join(sorted((v.result.precision_in_effect.get("forward") or {}).keys()))),
    _C(
        "collective_op",
        lambda v: collective_of(v).op if collective_of(v) else None,
        "collective.op",
        _if(collective_of, lambda v: str(collective_of(v).op)),
    ),
    _C(
        "collective_missing_ranks",
        lambda v: _joined(collective_of(v).missing_ranks) or None if collective_of(v) else None,
        "collective.missing_ranks",
        _if(collective_of, lambda v: _joined(collective_of(v).missing_ranks)),
    ),
    _C(
        None,
        lambda v: collective_of(v).timeout_s if collective_of(v) else None,
        "collective.timeout_s",
        _if(collective_of, lambda v: str(collective_of(v).timeout_s)),
    ),
    _C("collective_diagnosis", lambda v: collective_of(v).kind if collective_of(v) else None, "collective.diagnosis"),
    _C(
        "collective_step",
        lambda v: collective_of(v).step if collective_of(v) else None,
        "collective.step",
        _if(collective_of, lambda v: str(collective_of(v).step)),
        dtype="int",
    ),
    _C("collective_seq", lambda v: collective_of(v).seq if collective_of(v) else None, dtype="int"),
    _C(
        "collective_last_steps", lambda v: json.dumps(collective_of(v).last_step_per_rank) if collective_of(v) else None
    ),
    # seconds from the last progress to the hang named while the ranks still ran (none: not named early)
    _C(
        "collective_named_after_s",
        lambda v: (collective_of(v).early or {}).get("quiet_for_s") if collective_of(v) else None,
        dtype="float",
    ),
    _C("straggler_rank", lambda v: v.straggler.get("rank"), "straggler.rank", dtype="int"),
    _C(
        "straggler_ratio",
        lambda v: v.straggler.get("median_ratio"),
        "straggler.ratio",
        _if(lambda v: v.straggler, lambda v: _g(v.straggler["median_ratio"])),
        dtype="float",
    ),
    _C(
        "collective_parted",
        lambda v: (
            f"rank(s) {_joined(collective_of(v).parted_ranks)} at step {collective_of(v).parted_at_step}"
            if collective_of(v) and collective_of(v).parted_ranks
            else None
        ),
    ),
    _C(
        "crashed_ranks",
        lambda v: _joined(crash_of(v).ranks) or None if crash_of(v) else None,
        "rank_crash.ranks",
        _if(crash_of, lambda v: _joined(crash_of(v).ranks)),
    ),
    _C(None, lambda v: crash_of(v).exit if crash_of(v) else None, "rank_crash.exit"),
    _C("attempts", lambda v: len(v.result.attempts or [None]), dtype="int"),
    _C("wall_s", lambda v: v.result.wall_s, dtype="float"),
    _C("stack_packages", lambda v: stack_packages(v.result.env)),
    _C("mlflow_run_id", lambda v: (v.result.tracking or {}).get("run_id")),
    _C(None, lambda v: (v.result.env.get("scheduler") or {}).get("SLURM_JOB_ID") or None, "slurm.job_id"),
    # the collectives slow while every rank kept pace (tunegrid.run.link_check): how many times the probe's
    # all-reduce prediction a step's collectives took, and their median seconds a step
    _C(
        "slow_link_ratio",
        lambda v: link_of(v).get("ratio"),
        "slow_link.ratio",
        _if(link_of, lambda v: _g(link_of(v)["ratio"])),
        dtype="float",
    ),
    _C(
        "slow_link_collective_s",
        lambda v: link_of(v).get("collective_s_median"),
        "slow_link.collective_s",
        _if(link_of, lambda v: _g(link_of(v)["collective_s_median"])),
        dtype="float",
    ),
)

# summary.csv's columns after the table's, read from each cell's metrics.jsonl (review/summary.py, review/quality.py)
QUALITY_SOURCED = ("step_time_noise", "loss_fall", "quality", "loss_deviation", "quality_note")
# the tags a run gets besides the table's: the axes and the effective batch (the axis table's, track/tags.py), the
# verdict (track/diagnosis.py's outcome_tags), the live run's count of attempts (run/cell_record.py: the sync has
# no such count to add), and the families named per package or source (track/tags.py)
TAGS_OUTSIDE = ("diagnosis", "mlflow.note.content", "failed", "fault.injected", "effective_batch", "attempts")
TAG_FAMILIES_OUTSIDE = ("stack.", "model.revision", "model.pinned", "data.revision", "data.pinned")


def summary_columns(view: CellView) -> dict[str, Any]:
    """The table's summary.csv columns of one cell, in the table's order."""
    return {c.name: c.value(view) for c in COLUMNS if c.name is not None}


def table_tags(view: CellView) -> dict[str, str]:
    """The table's tags of one cell run: those whose text is set."""
    tags = {c.tag: c.tag_of(view) for c in COLUMNS if c.tag is not None}
    return {name: text for name, text in tags.items() if text is not None}


def audit_cells(view: CellView) -> dict[str, Any]:
    """The report's audit table row of one cell: the labelled rows, each as the report shows it."""
    return {c.label: (c.shown or c.value)(view) for c in COLUMNS if c.label is not None}
