"""A cell's result as the column table (tunegrid.columns) reads it: the result beside its axes as trained, and
the parts of it the rows read.

Light module: no third-party import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tunegrid.diagnosis import CollectiveDiagnosis, NanDiagnosis, OomDiagnosis, RankCrash
from tunegrid.outcome import CellResult
from tunegrid.targets import modelled_step_s as target_step_s


@dataclass(frozen=True)
class CellView:
    """A cell's result beside its axes as trained (the neutral value of an axis it predates, or the setting an
    axis stands for: review/summary.py resolves them), and the parts of it the rows read."""

    result: CellResult
    axes: dict[str, Any]

    @property
    def final_audit(self) -> dict[str, Any]:
        """The quantization audit after the adapters were added (empty where none was taken)."""
        return self.result.quant_audit.get("after_adapters") or {}

    @property
    def straggler(self) -> dict[str, Any]:
        """The straggler a timeout was blamed on, else the early warning of a cell that did not time out."""
        collective = self.result.diagnosis.collective
        return (collective.straggler if collective else None) or self.result.distributed.get("straggler") or {}

    @property
    def worst_headroom(self) -> dict[str, Any]:
        return (self.result.fp16_headroom.get("worst_modules") or [{}])[0]

    @property
    def islands(self) -> list[dict[str, Any]]:
        return (self.result.fp32_islands or {}).get("modules", [])


def nan_of(v: CellView) -> NanDiagnosis | None:
    return v.result.diagnosis.nan


def collective_of(v: CellView) -> CollectiveDiagnosis | None:
    return v.result.diagnosis.collective


def crash_of(v: CellView) -> RankCrash | None:
    return v.result.diagnosis.rank_crash


def oom_of(v: CellView) -> OomDiagnosis | None:
    return v.result.diagnosis.oom


def memory_of(v: CellView, key: str) -> Any:
    return v.result.memory.get(key)


def link_of(v: CellView) -> dict[str, Any]:
    return v.result.distributed.get("slow_link") or {}  # collectives slow while every rank kept pace


def ratio_text(v: CellView) -> str:
    ratio = memory_of(v, "estimate_over_measured")
    return f"{ratio:.3f}" if ratio else ""


def flagged_names(v: CellView) -> str:
    flagged = v.final_audit.get("flagged") or []
    names = ", ".join(f.get("name", "") if isinstance(f, dict) else str(f) for f in flagged[:4])
    return names + (f" (+{len(flagged) - 4})" if len(flagged) > 4 else "")


def modelled_step_s(result: CellResult, precision: str, checkpointing: bool) -> float | None:
    """The cell's step time on its named target as the data sheet models it (tunegrid.targets.modelled_step), from
    the FLOPs and the memory estimate its plan recorded and the bytes its fp32 islands grew by; None on the machine
    itself (its cells are measured), or where the plan holds neither."""
    flops = (result.plan.get("liveness") or {}).get("step_flops")
    components = (result.plan.get("estimate") or {}).get("components")
    widened = int((result.fp32_islands or {}).get("weights_widened_bytes") or 0)
    return target_step_s(result.plan.get("target"), precision, flops, components, widened, checkpointing=checkpointing)


def stack_packages(env: dict[str, Any]) -> str | None:
    """What a cell's library stack pinned, as resolved (`transformers==4.57.6`); None on the base stack."""
    stack = env.get("stack") or {}
    versions = stack.get("versions") or {}
    pins = stack.get("pins") or {}
    return " ".join(f"{name}=={versions.get(name) or pins[name]}" for name in sorted(pins)) or None
