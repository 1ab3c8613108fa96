"""From failure signatures to the setting that the grid itself shows working.

Every recommendation names the cells that failed and the cells that prove the fix (same model and
every other axis equal, one setting changed, outcome ok). A fix the grid has not run is never
suggested: where no sibling cell supports a fix, the failure stays in the failures table only.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from tunegrid.targets import TARGETS

AXES = ("model", "precision", "batch_size", "quant", "seed", "world_size")
EXPERT_GAP_SHARE = 0.2  # experts left unquantized worth more than this share of the weights is a gap


@dataclass
class Recommendation:
    signature: str  # what failed, e.g. "nan:fp16"
    title: str
    text: str
    failing: list[str]
    evidence: list[str]
    fix: dict[str, Any] = field(default_factory=dict)  # the setting to change: axis -> value

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _axes(frame: Any) -> list[str]:
    return [a for a in AXES if a in frame.columns]


def siblings(frame: Any, row: Any, vary: str) -> Any:
    """Cells equal to `row` on every axis but `vary`."""
    mask = frame[vary] != row[vary]
    for axis in _axes(frame):
        if axis != vary:
            mask &= frame[axis] == row[axis]
    return frame[mask]


def _ok(frame: Any) -> Any:
    return frame[frame["outcome"] == "ok"]


def precision_support(target: str | None, capabilities: dict[str, Any]) -> dict[str, str]:
    if target and target in TARGETS:
        return dict(TARGETS[target].precision)
    return dict(capabilities.get("precision") or {})


def _bytes(value: Any) -> str:
    if value is None or value != value:
        return "n/a"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    return f"{size:.2f} GiB"


def _short(module: Any) -> str:
    text = str(module or "")
    for prefix in ("base_model.model.model.", "base_model.model.", "model."):
        if text.startswith(prefix):
            return text[len(prefix):]
    return text or "unknown"


def _nan_fixes(frame: Any, capabilities: dict[str, Any]) -> list[Recommendation]:
    failing = frame[frame["outcome"] == "nan"]
    groups: dict[tuple[Any, ...], list[Any]] = defaultdict(list)
    for _, row in failing.iterrows():
        groups[(row["model"], row["precision"], row.get("target"))].append(row)
    out = []
    for (model, precision, target), rows in groups.items():
        support = precision_support(target, capabilities)
        by_precision: dict[str, set[str]] = defaultdict(set)
        by_batch: dict[int, set[str]] = defaultdict(set)
        by_quant: dict[str, set[str]] = defaultdict(set)
        for row in rows:
            for _, sib in _ok(siblings(frame, row, "quant")).iterrows():
                by_quant[sib["quant"]].add(sib["cell_id"])
            for _, sib in _ok(siblings(frame, row, "precision")).iterrows():
                by_precision[sib["precision"]].add(sib["cell_id"])
            for _, sib in _ok(siblings(frame, row, "batch_size")).iterrows():
                if sib["batch_size"] < row["batch_size"]:
                    by_batch[int(sib["batch_size"])].add(sib["cell_id"])
        if not by_precision and not by_batch and not by_quant:
            continue
        first = min(rows, key=lambda r: (r["nan_step"] if r["nan_step"] == r["nan_step"] else 1e9))
        where = _short(first["nan_forward_module"] or first["nan_backward_module"])
        direction = "forward" if first["nan_forward_module"] else "backward"
        parts = [
            f"{model} in {precision} went non-finite ({first['nan_kind']}) in {len(rows)} cell(s), first at step "
            f"{int(first['nan_step'])}; the first non-finite output in the {direction} pass was {where}."
        ]
        options, evidence, fix = [], [], {}
        for alt in ("bf16", "fp32", "fp16"):
            cells = sorted(by_precision.get(alt, ()))
            if not cells:
                continue
            evidence += cells
            native = support.get(alt, "absent") == "native"
            where_target = f"target {target}" if target and target != "native" else "this machine"
            if native:
                options.append(f"switch to {alt}: the same cells in {alt} trained without a non-finite step")
                fix.setdefault("precision", alt)
            else:
                parts.append(
                    f"The same cells in {alt} were ok, but {where_target} has {support.get(alt, 'no')} {alt}"
                    f" ({'slow software path' if support.get(alt) == 'emulated' else 'not available'})."
                )
        if by_batch:
            batch = max(by_batch)
            cells = sorted(by_batch[batch])
            evidence += cells
            options.append(f"keep {precision} with batch_size {batch} (ok in {precision})")
            fix.setdefault("batch_size", batch)
        for quant, cells in sorted(by_quant.items()):
            evidence += sorted(cells)
            options.append(f"keep {precision} with quant={quant} (ok in {precision}; it changes the weights the overflow came from)")
            fix.setdefault("quant", quant)
        if not options:
            continue
        parts.append("Fix: " + "; or ".join(options) + ".")
        if precision == "fp16" and "fp32" not in fix.get("precision", "") and support.get("bf16") != "native":
            parts.append("On a target without native bf16, fp32 costs about twice the activation memory of fp16.")
        out.append(
            Recommendation(
                signature=f"nan:{precision}",
                title=f"{model}: non-finite loss in {precision}",
                text=" ".join(parts),
                failing=sorted(r["cell_id"] for r in rows),
                evidence=sorted(set(evidence)),
                fix=fix,
            )
        )
    return out


def _expert_gap(frame: Any) -> list[Recommendation]:
    """One recommendation per model: plain-4-bit cells with unquantized experts vs their nf4-experts twins."""
    if "quant" not in frame.columns:
        return []
    gap = frame[(frame["quant"] == "nf4") & (frame["flagged_share"].fillna(0) >= EXPERT_GAP_SHARE) & frame["expert_bytes"].notna()]
    pairs: dict[str, list[tuple[Any, Any]]] = defaultdict(list)
    for _, row in gap.iterrows():
        fixed = siblings(frame, row, "quant")
        fixed = fixed[(fixed["quant"] == "nf4-experts") & (fixed["outcome"] == "ok")]
        if not fixed.empty:
            pairs[row["model"]].append((row, fixed.iloc[0]))
    out = []
    for model, members in pairs.items():
        row, sib = members[0]
        shares = [float(r["flagged_share"]) for r, _ in members]
        peak_cuts = [f"{_bytes(r['peak_bytes'])} -> {_bytes(s['peak_bytes'])} ({r['precision']}, bs {int(r['batch_size'])})" for r, s in members]
        failed = [f"{r['cell_id']} ended {r['outcome']}" for r, _ in members if r["outcome"] != "ok"]
        text = (
            f"Plain 4-bit loading left {int(row['flagged_tensors'])} tensor(s) in full precision: "
            f"{min(shares):.0%}-{max(shares):.0%} of the weight bytes. bitsandbytes only replaces nn.Linear, and "
            f"transformers v5 keeps fused experts as 3-D parameters. quant=nf4-experts cut the weights from "
            f"{_bytes(row['weight_bytes'])} to {_bytes(sib['weight_bytes'])} ({row['cell_id']} vs {sib['cell_id']}); "
            f"measured peaks: " + "; ".join(peak_cuts) + "."
        )
        if failed:
            text = "; ".join(failed) + ", its nf4-experts twin was ok. " + text
        out.append(
            Recommendation(
                signature="moe_expert_gap",
                title=f"{model}: experts not quantized by plain 4-bit",
                text=text,
                failing=sorted(r["cell_id"] for r, _ in members),
                evidence=sorted(s["cell_id"] for _, s in members),
                fix={"quant": "nf4-experts"},
            )
        )
    return out


def _memory_fixes(frame: Any) -> list[Recommendation]:
    out = []
    for _, row in frame[frame["outcome"].isin(["oom", "predicted_oom"])].iterrows():
        options, evidence, fix = [], [], {}
        smaller = _ok(siblings(frame, row, "batch_size"))
        smaller = smaller[smaller["batch_size"] < row["batch_size"]]
        if not smaller.empty:
            best = smaller.sort_values("batch_size").iloc[-1]
            options.append(f"batch_size {int(best['batch_size'])} fits (peak {_bytes(best['peak_bytes'])})")
            evidence.append(best["cell_id"])
            fix["batch_size"] = int(best["batch_size"])
        for quant in ("nf4-experts", "nf4"):
            alt = _ok(siblings(frame, row, "quant"))
            alt = alt[alt["quant"] == quant]
            if not alt.empty:
                options.append(f"quant={quant} fits (peak {_bytes(alt.iloc[0]['peak_bytes'])})")
                evidence.append(alt.iloc[0]["cell_id"])
                fix.setdefault("quant", quant)
                break
        if not options:
            continue
        stage = f" at {row['oom_stage']}" if row.get("oom_stage") == row.get("oom_stage") and row.get("oom_stage") else ""
        out.append(
            Recommendation(
                signature=f"{row['outcome']}",
                title=f"{row['cell_id']}: out of memory{stage}",
                text=f"{row['cell_id']} ended {row['outcome']}{stage} ({row['reason']}). Fix: " + "; or ".join(options) + ".",
                failing=[row["cell_id"]],
                evidence=evidence,
                fix=fix,
            )
        )
    return out


def _unsupported_fixes(frame: Any) -> list[Recommendation]:
    rows = frame[frame["outcome"] == "unsupported"]
    groups: dict[tuple[Any, ...], list[Any]] = defaultdict(list)
    for _, row in rows.iterrows():
        groups[(row["precision"], row.get("target"))].append(row)
    out = []
    for (precision, target), members in groups.items():
        ok: dict[str, set[str]] = defaultdict(set)
        for row in members:
            for _, sib in _ok(siblings(frame, row, "precision")).iterrows():
                ok[sib["precision"]].add(sib["cell_id"])
        if not ok:
            continue
        choice = "fp32" if "fp32" in ok else sorted(ok)[0]
        out.append(
            Recommendation(
                signature=f"unsupported:{precision}",
                title=f"{precision} cannot run on target {target}",
                text=(
                    f"{len(members)} cell(s) in {precision} were not trained: {members[0]['reason']}. "
                    f"On {target}, {choice} ran ok for the same settings ({len(ok[choice])} cell(s))."
                ),
                failing=sorted(r["cell_id"] for r in members),
                evidence=sorted(ok[choice]),
                fix={"precision": choice},
            )
        )
    return out


def _timeout_fixes(frame: Any) -> list[Recommendation]:
    out = []
    if "collective_op" not in frame.columns:
        return out
    for _, row in frame[(frame["outcome"] == "timeout") & frame["collective_op"].notna()].iterrows():
        evidence, options, fix = [], [], {}
        if "world_size" in frame.columns:
            alt = _ok(siblings(frame, row, "world_size"))
            if not alt.empty:
                best = alt.sort_values("world_size").iloc[-1]
                evidence.append(best["cell_id"])
                options.append(f"world_size {int(best['world_size'])} was ok")
                fix["world_size"] = int(best["world_size"])
        missing = row.get("collective_missing_ranks") or "unknown"
        text = (
            f"Collective timeout: rank(s) {missing} never reached {row['collective_op']} "
            f"(seq {row.get('collective_seq') or 'n/a'}); the other ranks waited {row.get('collective_timeout_s')} s, "
            f"the timeout in effect. The straggler, not the network, is the cause to chase: its last step was "
            f"{row.get('collective_last_steps') or 'n/a'}."
        )
        if options:
            text += " In this grid, " + "; ".join(options) + "."
        out.append(
            Recommendation(
                signature="timeout:collective",
                title=f"{row['cell_id']}: collective timeout",
                text=text,
                failing=[row["cell_id"]],
                evidence=evidence or [row["cell_id"]],
                fix=fix,
            )
        )
    return out


def recommend(frame: Any, capabilities: dict[str, Any] | None = None) -> list[Recommendation]:
    """Every recommendation the grid supports, most severe failure kinds first."""
    capabilities = capabilities or {}
    return [
        *_nan_fixes(frame, capabilities),
        *_memory_fixes(frame),
        *_expert_gap(frame),
        *_timeout_fixes(frame),
        *_unsupported_fixes(frame),
    ]
