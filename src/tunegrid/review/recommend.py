"""From failure signatures to the setting that the grid itself shows working.

Every recommendation names the cells that failed and the cells that prove the fix (same model and
every other axis equal, one setting changed, outcome ok). A fix the grid has not run is never
suggested: where no sibling cell supports a fix, the failure stays in the failures table only. Each
alternative is a fix of its own (one changed setting, or a smaller micro-batch with the accumulation that
keeps the effective batch; its reason and its evidence), and a change is
never recommended for a goal the grid's own measurements contradict (a memory fix whose peaks rose).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from tunegrid.prepare.targets import TARGETS
from tunegrid.review.batch_advice import memory_batch_fix, smaller_batch_fix
from tunegrid.units import human_bytes
from tunegrid.vocabulary import AXES, Outcome

EXPERT_GAP_SHARE = 0.2  # experts left unquantized worth more than this share of the weights is a gap


@dataclass
class Fix:
    """One alternative: the settings to change, why, and the ok cells that show it working."""

    change: dict[str, Any]  # axis -> value
    why: str
    evidence: list[str]


@dataclass
class Recommendation:
    signature: str  # what failed, e.g. "nan:fp16"
    title: str
    text: str
    failing: list[str]  # cells that did not end ok
    evidence: list[str]
    fixes: list[Fix] = field(default_factory=list)  # alternatives, each on its own; empty = a finding only
    concerns: list[str] = field(default_factory=list)  # cells the advice is about, failed or not

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
    return frame[frame["outcome"] == Outcome.OK]


def precision_support(target: str | None, capabilities: dict[str, Any]) -> dict[str, str]:
    if target and target in TARGETS:
        return dict(TARGETS[target].precision)
    return dict(capabilities.get("precision") or {})


def _short(module: Any) -> str:
    text = str(module or "")
    for prefix in ("base_model.model.model.", "base_model.model.", "model."):
        if text.startswith(prefix):
            return text[len(prefix) :]
    return text or "unknown"


def _nan_fixes(frame: Any, capabilities: dict[str, Any]) -> list[Recommendation]:
    failing = frame[frame["outcome"] == Outcome.NAN]
    groups: dict[tuple[Any, ...], list[Any]] = defaultdict(list)
    for _, row in failing.iterrows():
        groups[(row["model"], row["precision"], row.get("target"))].append(row)
    out = []
    for (model, precision, target), rows in groups.items():
        support = precision_support(target, capabilities)
        by_precision: dict[str, set[str]] = defaultdict(set)
        by_quant: dict[str, set[str]] = defaultdict(set)
        for row in rows:
            for _, sib in _ok(siblings(frame, row, "quant")).iterrows():
                by_quant[sib["quant"]].add(sib["cell_id"])
            for _, sib in _ok(siblings(frame, row, "precision")).iterrows():
                by_precision[sib["precision"]].add(sib["cell_id"])
        batch_fix, batch_note = smaller_batch_fix(frame, rows, precision)  # the effective batch kept, or why not
        if not by_precision and not batch_fix and not batch_note and not by_quant:
            continue
        first = min(rows, key=lambda r: r["nan_step"] if r["nan_step"] == r["nan_step"] else 1e9)
        where = _short(first["nan_forward_module"] or first["nan_backward_module"])
        direction = "forward" if first["nan_forward_module"] else "backward"
        parts = [
            f"{model} in {precision} went non-finite{_paren(first['nan_kind'])} in {len(rows)} cell(s), first at step "
            f"{int(first['nan_step'])}; the first non-finite output in the {direction} pass was {where}."
        ]
        options, evidence, fixes = [], [], []
        for alt in ("bf16", "fp32", "fp16"):
            cells = sorted(by_precision.get(alt, ()))
            if not cells:
                continue
            evidence += cells
            native = support.get(alt, "absent") == "native"
            where_target = f"target {target}" if target and target != "native" else "this machine"
            if native:
                options.append(f"switch to {alt}: the same cells in {alt} trained without a non-finite step")
                fixes.append(Fix({"precision": alt}, options[-1], cells))
            else:
                parts.append(
                    f"The same cells in {alt} were ok, but {where_target} has {support.get(alt, 'no')} {alt}"
                    f" ({'slow software path' if support.get(alt) == 'emulated' else 'not available'})."
                )
        if batch_fix:
            evidence += batch_fix["evidence"]
            options.append(batch_fix["why"])
            fixes.append(Fix(**batch_fix))
        if batch_note:
            parts.append(batch_note)
        for quant, cells in sorted(by_quant.items()):
            evidence += sorted(cells)
            options.append(
                f"keep {precision} with quant={quant} (ok in {precision}; it changes the weights the overflow came from)"
            )
            fixes.append(Fix({"quant": quant}, options[-1], sorted(cells)))
        if not options and not batch_note:
            continue
        if options:
            parts.append("Fix: " + "; or ".join(options) + ".")
        first_fix = fixes[0].change.get("precision", "") if fixes else ""
        if precision == "fp16" and first_fix != "fp32" and support.get("bf16") != "native":
            parts.append("On a target without native bf16, fp32 costs about twice the activation memory of fp16.")
        out.append(
            Recommendation(
                signature=f"nan:{precision}",
                title=f"{model}: non-finite loss in {precision}",
                text=" ".join(parts),
                failing=sorted(r["cell_id"] for r in rows),
                evidence=sorted(set(evidence)),
                fixes=fixes,
                concerns=sorted(r["cell_id"] for r in rows),
            )
        )
    return out


def _expert_gap(frame: Any) -> list[Recommendation]:
    """One recommendation per model: plain-4-bit cells with unquantized experts vs their nf4-experts twins."""
    if "quant" not in frame.columns:
        return []
    gap = frame[
        (frame["quant"] == "nf4")
        & (frame["flagged_share"].fillna(0) >= EXPERT_GAP_SHARE)
        & frame["expert_bytes"].notna()
    ]
    pairs: dict[str, list[tuple[Any, Any]]] = defaultdict(list)
    for _, row in gap.iterrows():
        fixed = siblings(frame, row, "quant")
        fixed = fixed[(fixed["quant"] == "nf4-experts") & (fixed["outcome"] == Outcome.OK)]
        if not fixed.empty:
            pairs[row["model"]].append((row, fixed.iloc[0]))
    out = []
    for model, members in pairs.items():
        row, sib = members[0]
        shares = [float(r["flagged_share"]) for r, _ in members]
        peak_pairs = [
            f"{human_bytes(r['peak_bytes'])} -> {human_bytes(s['peak_bytes'])} ({r['precision']}, bs {int(r['batch_size'])})"
            for r, s in members
        ]
        failed = [r for r, _ in members if r["outcome"] != Outcome.OK]
        # the goal is memory: recommend only where the twins' peaks show it (or a plain-4-bit cell failed and its twin ran)
        peaks_fell = all(
            _number(s["peak_bytes"]) < _number(r["peak_bytes"]) for r, s in members if r["outcome"] == Outcome.OK
        )
        text = (
            f"Plain 4-bit loading left {int(row['flagged_tensors'])} tensor(s) in full precision: "
            f"{min(shares):.0%}-{max(shares):.0%} of the weight bytes. bitsandbytes only replaces nn.Linear, and "
            f"transformers v5 keeps fused experts as 3-D parameters. quant=nf4-experts cut the weights from "
            f"{human_bytes(row['weight_bytes'])} to {human_bytes(sib['weight_bytes'])} ({row['cell_id']} vs {sib['cell_id']}); "
            f"measured peaks: " + "; ".join(peak_pairs) + "."
        )
        if failed:
            text = (
                "; ".join(f"{r['cell_id']} ended {r['outcome']}" for r in failed)
                + ", its nf4-experts twin was ok. "
                + text
            )
        evidence = sorted(s["cell_id"] for _, s in members)
        if peaks_fell or failed:
            title, fixes = (
                f"{model}: experts not quantized by plain 4-bit",
                [Fix({"quant": "nf4-experts"}, "quantize the experts too", evidence)],
            )
        else:
            title, fixes = f"{model}: nf4-experts shrinks the weights, but the peaks did not fall here", []
            text += " Not recommended for memory on this machine: the whole-process peak is set by something else here."
        out.append(
            Recommendation(
                signature="moe_expert_gap",
                title=title,
                text=text,
                failing=sorted(r["cell_id"] for r in failed),
                evidence=evidence,
                fixes=fixes,
                concerns=sorted(r["cell_id"] for r, _ in members),
            )
        )
    return out


def _paren(value: Any) -> str:
    """ " (value)", or nothing for an empty value: no "()" in what a person reads."""
    return f" ({value})" if value is not None and value == value and str(value) else ""


def _number(value: Any) -> float:
    return float(value) if value is not None and value == value else float("inf")


def _load_peaks(row: Any, fixed: Any) -> str:
    """For an OOM at load that the experts quantized as they load fixed: both load peaks, as measured."""
    at_load = row.get("oom_stage") == "load" and _number(row.get("oom_peak_bytes")) < float("inf")
    if not at_load or fixed["quant"] != "nf4-experts":
        return ""
    failed = human_bytes(row["oom_peak_bytes"])
    return f"; load peak {human_bytes(fixed['load_peak_bytes'])}, where {row['quant']} failed at {failed}"


def _memory_fixes(frame: Any) -> list[Recommendation]:
    out = []
    for _, row in frame[frame["outcome"].isin([Outcome.OOM, Outcome.PREDICTED_OOM])].iterrows():
        options, evidence, fixes = [], [], []
        batch_fix, batch_note = memory_batch_fix(frame, row)  # the effective batch kept, or why not
        if batch_fix:
            options.append(batch_fix["why"])
            evidence += batch_fix["evidence"]
            fixes.append(Fix(**batch_fix))
        for quant in ("nf4-experts", "nf4"):
            alt = _ok(siblings(frame, row, "quant"))
            alt = alt[alt["quant"] == quant]
            if not alt.empty:
                peak = human_bytes(alt.iloc[0]["peak_bytes"])
                options.append(f"quant={quant} fits (peak {peak}{_load_peaks(row, alt.iloc[0])})")
                evidence.append(alt.iloc[0]["cell_id"])
                fixes.append(Fix({"quant": quant}, options[-1], [alt.iloc[0]["cell_id"]]))
                break
        if not options and not batch_note:
            continue
        stage = f" at {row['oom_stage']}" if isinstance(row.get("oom_stage"), str) and row["oom_stage"] else ""
        out.append(
            Recommendation(
                signature=f"{row['outcome']}",
                title=f"{row['cell_id']}: out of memory{stage}",
                text=f"{row['cell_id']} ended {row['outcome']}{stage} ({row['reason']})."
                + (" Fix: " + "; or ".join(options) + "." if options else "")
                + (f" {batch_note}" if batch_note else ""),
                failing=[row["cell_id"]],
                evidence=evidence,
                fixes=fixes,
                concerns=[row["cell_id"]],
            )
        )
    return out


def _unsupported_fixes(frame: Any) -> list[Recommendation]:
    rows = frame[frame["outcome"] == Outcome.UNSUPPORTED]
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
                fixes=[Fix({"precision": choice}, f"{choice} ran ok for the same settings", sorted(ok[choice]))],
                concerns=sorted(r["cell_id"] for r in members),
            )
        )
    return out


def _timeout_fixes(frame: Any) -> list[Recommendation]:
    out = []
    if "collective_op" not in frame.columns:
        return out
    for _, row in frame[(frame["outcome"] == Outcome.TIMEOUT) & frame["collective_op"].notna()].iterrows():
        evidence, options, fixes = [], [], []
        if "world_size" in frame.columns:
            alt = _ok(siblings(frame, row, "world_size"))
            if not alt.empty:
                best = alt.sort_values("world_size").iloc[-1]
                evidence.append(best["cell_id"])
                options.append(f"world_size {int(best['world_size'])} was ok")
                fixes.append(Fix({"world_size": int(best["world_size"])}, options[-1], [best["cell_id"]]))
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
                evidence=evidence,
                fixes=fixes,
                concerns=[row["cell_id"]],
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
