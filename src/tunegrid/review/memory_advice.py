"""Out of memory: the memory fixes the grid proved, cheapest first, and what each memory setting saves and costs.

For a cell that ran out of memory, every ok twin that differs in one memory setting is a fix: the optimizer
(8-bit or paged 8-bit state), activation checkpointing, the quantization, or a smaller micro-batch with the
accumulation that keeps the effective batch. A twin is cited only where its quality holds (review/quality.py: it
learned, and its loss matched its reference twin's within tolerance); an ok twin that did not learn or deviates
is named as no evidence of a fix. Each fix is cited with its peak, its throughput against the fastest fix, and
its loss parity (its loss deviation from its reference twin). Where a twin learned but the study has no ok
reference twin for it (often because the reference settings are what ran out of memory), its loss is shown
beside the failing cell's at the failing cell's last finite step instead, and the text says so. They are ranked
by throughput: all of them fit, so the fastest costs least.
"""

from __future__ import annotations

import math
from typing import Any

from tunegrid.plans import memory_fix_quants
from tunegrid.review.advice import (
    Fix,
    Recommendation,
    holds,
    no_evidence,
    ok_cells,
    parity_of,
    parity_text,
    siblings,
    unproven_name,
    unreferenced,
)
from tunegrid.review.batch_advice import memory_batch_fix
from tunegrid.review.moe_advice import load_peaks
from tunegrid.units import human_bytes
from tunegrid.vocabulary import Outcome, axis_names

MEMORY_SETTINGS = ("optimizer", "activation_checkpointing")  # besides quant and the micro-batch


def _setting(axis: str, value: Any) -> str:
    if axis == "activation_checkpointing":
        return "activation checkpointing " + ("on" if value else "off")
    return f"{axis}={value}"


def _last_finite(curve: list[dict[str, Any]]) -> tuple[int, float] | None:
    finite = [(int(r["step"]), float(r["loss"])) for r in curve if isinstance(r.get("loss"), float | int)]
    finite = [(s, v) for s, v in finite if math.isfinite(v)]
    return finite[-1] if finite else None


def _fallback_parity(row: Any, twin: Any, curves: dict[str, list[dict[str, Any]]]) -> str:
    """For a twin with no reference twin: its loss at the failing cell's last finite step, beside the failing
    cell's."""
    unchecked = (
        "no ok reference twin in this study to check its loss against"
        if unreferenced(twin)
        else "not compared with a reference"  # a summary without the quality columns
    )
    failed = _last_finite(curves.get(row["cell_id"]) or [])
    fix_curve = curves.get(twin["cell_id"]) or []
    if failed is None:
        last = _last_finite(fix_curve)
        ran = f"loss {last[1]:.4g} at step {last[0]}; " if last else ""
        return f"{unchecked}: {ran}the failing cell ran no step to compare"
    step, loss = failed
    at = next((float(r["loss"]) for r in fix_curve if int(r["step"]) == step), None)
    beside = f"loss at step {step} {at:.4g} vs {loss:.4g} in the failing setting" if at is not None else "no loss"
    return f"{unchecked}: {beside}"


def _evidence(twin: Any) -> bool:
    """A memory fix's evidence: its quality holds, or it learned where the study ran no ok reference twin."""
    return holds(twin) or unreferenced(twin)


def _candidates(frame: Any, row: Any) -> tuple[list[tuple[dict[str, Any], str, Any]], list[str]]:
    """(change, why-prefix, twin row) of each ok twin one memory setting away that is evidence, and the names
    of the ok ones that are not."""
    found, unproven = [], []
    batch_fix, _ = memory_batch_fix(frame, row, _evidence)
    if batch_fix:
        twin = frame[frame["cell_id"] == batch_fix["evidence"][0]].iloc[0]
        found.append((batch_fix["change"], batch_fix["why"], twin))
    for quant in memory_fix_quants():
        alt = ok_cells(siblings(frame, row, "quant"))
        alt = alt[alt["quant"] == quant]
        unproven += [unproven_name(t) for _, t in alt.iterrows() if not _evidence(t)]
        alt = alt[alt.apply(_evidence, axis=1)] if not alt.empty else alt
        if not alt.empty:
            twin = alt.iloc[0]
            found.append(
                (
                    {"quant": quant},
                    f"quant={quant} fits (peak {human_bytes(twin['peak_bytes'])}" + f"{load_peaks(row, twin)})",
                    twin,
                )
            )
            break
    for axis in MEMORY_SETTINGS:
        if axis not in frame.columns:
            continue
        for _, twin in ok_cells(siblings(frame, row, axis)).iterrows():
            if not _evidence(twin):
                unproven.append(unproven_name(twin))
                continue
            value = twin[axis].item() if hasattr(twin[axis], "item") else twin[axis]
            why = f"{_setting(axis, value)} fits (peak {human_bytes(twin['peak_bytes'])})"
            found.append(({axis: value}, why, twin))
    return found, unproven


def memory_fixes(frame: Any, curves: dict[str, list[dict[str, Any]]] | None = None) -> list[Recommendation]:
    curves = curves or {}
    out = []
    for _, row in frame[frame["outcome"].isin([Outcome.OOM, Outcome.PREDICTED_OOM])].iterrows():
        found, unproven = _candidates(frame, row)
        _, batch_note = memory_batch_fix(frame, row, _evidence)
        if not found and not batch_note and not unproven:
            continue
        speeds = [float(t.get("tokens_per_s", float("nan"))) for _, _, t in found]
        fastest = max((s for s in speeds if s == s), default=float("nan"))
        ranked = sorted(zip(found, speeds, strict=True), key=lambda item: -item[1] if item[1] == item[1] else 0)
        options, fixes = [], []
        for (change, why, twin), speed in ranked:
            cost = f", {speed:.0f} tokens/s ({speed / fastest:.2f} of the fastest fix)" if speed == speed else ""
            parity = parity_text(twin) or _fallback_parity(row, twin, curves)
            options.append(why + cost + f", {parity}")
            fixes.append(Fix(change, options[-1], [twin["cell_id"]], parity_of(twin)))
        stage = f" at {row['oom_stage']}" if isinstance(row.get("oom_stage"), str) and row["oom_stage"] else ""
        ranking = " Ranked by throughput, fastest first." if len(fixes) > 1 else ""
        notes = [no_evidence("A memory setting", unproven)] if unproven else []
        notes += [batch_note] if batch_note else []
        out.append(
            Recommendation(
                signature=f"{row['outcome']}",
                title=f"{row['cell_id']}: out of memory{stage}",
                text=f"{row['cell_id']} ended {row['outcome']}{stage} ({row['reason']})."
                + (" Fix: " + "; or ".join(options) + "." + ranking if options else "")
                + "".join(f" {note}" for note in notes),
                failing=[row["cell_id"]],
                evidence=[f.evidence[0] for f in fixes],
                fixes=fixes,
                concerns=[row["cell_id"]],
            )
        )
    return out


def memory_setting_rows(frame: Any) -> list[dict[str, Any]]:
    """Each ok cell with a memory setting on (8-bit optimizer, activation checkpointing) beside its plain twin
    (adamw, no checkpointing, every other axis equal): the peak it saves and the throughput it costs."""
    if not set(MEMORY_SETTINGS) <= set(frame.columns):
        return []
    ok = ok_cells(frame)
    plain = ok[(ok["optimizer"] == "adamw") & (~ok["activation_checkpointing"].astype(bool))]
    others = [a for a in axis_names() if a in frame.columns and a not in MEMORY_SETTINGS]
    rows = []
    for _, cell in ok.iterrows():
        if cell["optimizer"] == "adamw" and not bool(cell["activation_checkpointing"]):
            continue
        mask = plain.index == plain.index
        for axis in others:
            mask &= plain[axis] == cell[axis]
        if not mask.any():
            continue
        base = plain[mask].iloc[0]
        settings = [cell["optimizer"]] if cell["optimizer"] != "adamw" else []
        settings += ["activation checkpointing"] if bool(cell["activation_checkpointing"]) else []
        rows.append(
            {
                "cell_id": cell["cell_id"],
                "setting": " + ".join(settings),
                "plain cell": base["cell_id"],
                "peak_bytes": cell["peak_bytes"],
                "peak / plain": cell["peak_bytes"] / base["peak_bytes"],
                "tokens/s / plain": cell["tokens_per_s"] / base["tokens_per_s"],
                "optimizer_state_bytes": cell.get("optimizer_state_bytes"),
                "estimate_over_measured": cell.get("estimate_over_measured"),
                "final loss - plain": cell["final_loss"] - base["final_loss"],
            }
        )
    return rows
