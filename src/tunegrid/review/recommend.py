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

from tunegrid.outcome import module_name
from tunegrid.review.advice import Fix, Recommendation, ok_cells, paren, siblings
from tunegrid.review.batch_advice import smaller_batch_fix
from tunegrid.review.memory_advice import memory_fixes
from tunegrid.review.moe_advice import expert_gap
from tunegrid.review.precision_advice import candidates, holds, precision_fixes
from tunegrid.review.stack_advice import stack_fixes
from tunegrid.review.timeout_advice import timeout_fixes
from tunegrid.vocabulary import Outcome, Precision


def _short(module: Any) -> str:
    """The module as every other line of the report spells it (outcome.module_name)."""
    return module_name(str(module or "")) or "unknown"


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


def recommend(
    frame: Any, capabilities: dict[str, Any] | None = None, curves: dict[str, list[dict[str, Any]]] | None = None
) -> list[Recommendation]:
    """Every recommendation the grid supports, most severe failure kinds first; `curves` (cell id -> its
    metrics.jsonl records) gives the memory fixes their loss parity."""
    capabilities = capabilities or {}
    return [
        *_nan_fixes(frame, capabilities),
        *memory_fixes(frame, curves),
        *expert_gap(frame),
        *stack_fixes(frame),
        *timeout_fixes(frame),
        *_unsupported_fixes(frame),
    ]
