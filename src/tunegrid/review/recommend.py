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
from typing import Any

from tunegrid.plans import memory_fix_quants
from tunegrid.review.advice import Fix, Recommendation, ok_cells, paren, siblings
from tunegrid.review.batch_advice import memory_batch_fix, smaller_batch_fix
from tunegrid.review.moe_advice import expert_gap, load_peaks
from tunegrid.review.precision_advice import candidates, holds, precision_fixes
from tunegrid.units import human_bytes
from tunegrid.vocabulary import Outcome, Precision


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
        by_quant: dict[str, set[str]] = defaultdict(set)
        for row in rows:
            for _, sib in ok_cells(siblings(frame, row, "quant")).iterrows():
                if holds(sib):
                    by_quant[sib["quant"]].add(sib["cell_id"])
        by_precision = candidates(frame, rows, precision)
        batch_fix, batch_note = smaller_batch_fix(frame, rows, precision)  # the effective batch kept, or why not
        if not by_precision and not batch_fix and not batch_note and not by_quant:
            continue
        first = min(rows, key=lambda r: r["nan_step"] if r["nan_step"] == r["nan_step"] else 1e9)
        where = _short(first["nan_forward_module"] or first["nan_backward_module"])
        direction = "forward" if first["nan_forward_module"] else "backward"
        parts = [
            f"{model} in {precision} went non-finite{paren(first['nan_kind'])} in {len(rows)} cell(s), first at step "
            f"{int(first['nan_step'])}; the first non-finite output in the {direction} pass was {where}."
        ]
        options, evidence = [], []
        fixes, notes = precision_fixes(frame, rows, precision, target, capabilities, _short)
        for fix in fixes:
            evidence += fix.evidence
            options.append(fix.why)
        parts += notes
        if batch_fix:
            evidence += batch_fix["evidence"]
            options.append(batch_fix["why"])
            fixes.append(Fix(**batch_fix))
        if batch_note:
            parts.append(batch_note)
        for quant, cells in sorted(by_quant.items()):
            evidence += sorted(cells)
            options.append(
                f"keep {precision} with quant={quant} (ok in {precision}; it changes the weights the overflow came "
                "from)"
            )
            fixes.append(Fix({"quant": quant}, options[-1], sorted(cells)))
        if not options and not batch_note:
            continue
        if options:
            parts.append("Fix: " + "; or ".join(options) + ".")
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


def _memory_fixes(frame: Any) -> list[Recommendation]:
    out = []
    for _, row in frame[frame["outcome"].isin([Outcome.OOM, Outcome.PREDICTED_OOM])].iterrows():
        options, evidence, fixes = [], [], []
        batch_fix, batch_note = memory_batch_fix(frame, row)  # the effective batch kept, or why not
        if batch_fix:
            options.append(batch_fix["why"])
            evidence += batch_fix["evidence"]
            fixes.append(Fix(**batch_fix))
        for quant in memory_fix_quants():
            alt = ok_cells(siblings(frame, row, "quant"))
            alt = alt[alt["quant"] == quant]
            if not alt.empty:
                peak = human_bytes(alt.iloc[0]["peak_bytes"])
                options.append(f"quant={quant} fits (peak {peak}{load_peaks(row, alt.iloc[0])})")
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
            for _, sib in ok_cells(siblings(frame, row, "precision")).iterrows():
                if holds(sib):
                    ok[sib["precision"]].add(sib["cell_id"])
        if not ok:
            continue
        choice = Precision.FP32 if Precision.FP32 in ok else sorted(ok)[0]
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
            alt = ok_cells(siblings(frame, row, "world_size"))
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
        *expert_gap(frame),
        *_timeout_fixes(frame),
        *_unsupported_fixes(frame),
    ]
