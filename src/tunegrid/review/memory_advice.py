"""Out of memory: the memory fixes the grid proved, cheapest first, and what each memory setting saves and costs.

For a cell that ran out of memory, every ok twin that differs in memory settings only is a fix: the optimizer
(8-bit or paged 8-bit state), activation checkpointing, the chunked loss, these together, the quantization, or a smaller
micro-batch with the accumulation that keeps the effective batch. A twin is cited only where its quality holds
(review/quality.py: it learned, and its loss matched its reference twin's within tolerance); an ok twin that did
not learn or deviates is named as no evidence of a fix. Each fix is cited with its peak, its throughput against
the fastest fix, and its loss parity. They are ranked by throughput: all of them fit, so the fastest costs least;
but a fix that adds settings to another fix (activation checkpointing with 8-bit AdamW, where checkpointing alone
fits) ranks after it, however fast: it changes more of the recipe for a failure the other already ends
(`adds_to`, `least_change_first`; the doctor reads the same rule to leave such a candidate unrun).

Loss parity, for a memory fix, is its loss against the setting that ran out of memory. Where the twin's reference
twin (review/quality.py) is another cell, that comparison is the parity shown. Where the twin sits at the
reference settings itself, or has no ok reference twin (often because the reference settings are what ran out of
memory), the failing setting is the reference. A cell that ran out of memory early has no loss to compare: step
0's loss is the model before any update, the same in every twin, and the optimizer's state joins the activations
only from step 1 on. Its arithmetic is still in the grid: activation checkpointing alone recomputes the same
forward in backward and takes the same optimizer steps, so that ok twin's curve stands for the failing setting's
and every other fix is compared with it over the last quarter of steps; that twin itself is compared with the
failing cell's steps where it logged some after step 0. Without either, the text says there was nothing to
compare.
"""

from __future__ import annotations

import math
from typing import Any

from tunegrid.meanings import memory_fix_quants
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
from tunegrid.review.quality import loss_curve, loss_deviation
from tunegrid.units import human_bytes
from tunegrid.vocabulary import LOSSES, Outcome, axis_names

MEMORY_SETTINGS = ("optimizer", "activation_checkpointing", "loss")  # besides quant and the micro-batch
PLAIN = {"optimizer": "adamw", "activation_checkpointing": False, "loss": LOSSES[0]}  # each setting off


def _setting(axis: str, value: Any) -> str:
    if axis == "activation_checkpointing":
        return "activation checkpointing " + ("on" if value else "off")
    if axis == "loss":
        return f"the {value} loss"
    return f"{axis}={value}"


def _settings(frame: Any) -> list[str]:
    """The memory settings this summary has columns for (one written before an axis lacks its column)."""
    return [axis for axis in MEMORY_SETTINGS if axis in frame.columns]


def _is_plain(cell: Any, settings: list[str]) -> bool:
    return all(_value(cell, a) == PLAIN[a] if a != "activation_checkpointing" else not bool(cell[a]) for a in settings)


def _value(twin: Any, axis: str) -> Any:
    return twin[axis].item() if hasattr(twin[axis], "item") else twin[axis]


def _finite_curve(curve: list[dict[str, Any]]) -> list[float]:
    """The losses of the steps before the first non-finite one (an oom cell's records end where it failed)."""
    out = []
    for loss in loss_curve(curve):
        if not math.isfinite(loss):
            break
        out.append(loss)
    return out


def _stand_in(frame: Any, row: Any) -> Any | None:
    """The ok twin with activation checkpointing on and every other axis the failing cell's: recomputation
    changes where activations live, not the arithmetic, so its curve stands for the failing setting's."""
    if "activation_checkpointing" not in frame.columns or bool(row["activation_checkpointing"]):
        return None
    twins = ok_cells(siblings(frame, row, "activation_checkpointing"))
    twins = twins[twins.apply(_evidence, axis=1)] if not twins.empty else twins
    return twins.iloc[0] if not twins.empty else None


def _memory_parity(frame: Any, row: Any, twin: Any, curves: dict[str, list[dict[str, Any]]]) -> tuple[Any, str]:
    """(loss deviation or None, the words) of a fix against the setting that ran out of memory."""
    reference = twin.get("reference_cell")
    if isinstance(reference, str) and reference and reference != twin["cell_id"] and parity_text(twin):
        return parity_of(twin), parity_text(twin)
    why = (
        "it is at the study's reference settings"
        if isinstance(reference, str) and reference == twin["cell_id"]
        else "no ok reference twin in this study to check its loss against"
        if unreferenced(twin)
        else "not compared with a reference"  # a summary without the quality columns
    )
    fix_curve = _finite_curve(curves.get(twin["cell_id"]) or [])
    failed = _finite_curve(curves.get(row["cell_id"]) or [])
    # step 0's loss is the model before any update, the same for every twin: only later steps show training
    ran = (
        "ran no step"
        if not failed
        else "logged only step 0's loss, before any update"
        if len(failed) == 1
        else f"ran {len(failed)} steps"
    )
    stand_in = _stand_in(frame, row)
    if stand_in is not None and stand_in["cell_id"] != twin["cell_id"]:
        deviation = loss_deviation(fix_curve, _finite_curve(curves.get(stand_in["cell_id"]) or []))
        if deviation is not None:
            return deviation, (
                f"{why}; loss within {_percent(deviation)} of {stand_in['cell_id']} over the last quarter of steps "
                f"(activation checkpointing alone: the failing setting's arithmetic; the failing cell {ran})"
            )
    if len(failed) > 1:
        deviation = loss_deviation(fix_curve, failed)
        at = (
            f"loss at step {len(failed) - 1} {fix_curve[len(failed) - 1]:.4g} vs {failed[-1]:.4g}"
            if len(fix_curve) >= len(failed)
            else "no loss"
        )
        return deviation, f"{why}: {at} in the failing setting"
    if stand_in is not None:
        return None, (
            f"{why}; activation checkpointing recomputes the failing setting's forward in backward (the same "
            f"arithmetic), so this curve stands for the failing setting's (the failing cell {ran})"
        )
    last = f"loss {fix_curve[-1]:.4g} at step {len(fix_curve) - 1}; " if fix_curve else ""
    return None, f"{why}: {last}the failing cell {ran}, nothing to compare"


def _percent(share: float) -> str:
    """A loss deviation in words: two significant digits where it is under 0.01 %."""
    return f"{share:.2%}" if share >= 1e-4 or share == 0 else f"{share * 100:.2g}%"


def _evidence(twin: Any) -> bool:
    """A memory fix's evidence: its quality holds, or it learned where the study ran no ok reference twin."""
    return holds(twin) or unreferenced(twin)


def _memory_twins(frame: Any, row: Any) -> Any:
    """Cells equal to `row` on every axis but the memory settings, differing in at least one of them."""
    mask = frame["cell_id"] != row["cell_id"]
    for axis in axis_names():
        if axis in frame.columns and axis not in MEMORY_SETTINGS:
            mask &= frame[axis] == row[axis]
    differs = frame["cell_id"] != frame["cell_id"]
    for axis in _settings(frame):
        differs |= frame[axis] != row[axis]
    return frame[mask & differs]


def _candidates(frame: Any, row: Any) -> tuple[list[tuple[dict[str, Any], str, Any]], list[str]]:
    """(change, why-prefix, twin row) of each ok twin memory settings away that is evidence, and the names of
    the ok ones that are not."""
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
    if _settings(frame):
        for _, twin in ok_cells(_memory_twins(frame, row)).iterrows():
            if not _evidence(twin):
                unproven.append(unproven_name(twin))
                continue
            change = {a: _value(twin, a) for a in _settings(frame) if twin[a] != row[a]}
            why = " with ".join(_setting(a, v) for a, v in change.items())
            found.append((change, f"{why} fits (peak {human_bytes(twin['peak_bytes'])})", twin))
    return found, unproven


def adds_to(change: dict[str, Any], other: dict[str, Any]) -> bool:
    """Whether `change` sets every setting `other` does, to the same value, and more besides."""
    return len(change) > len(other) and all(k in change and change[k] == v for k, v in other.items())


def least_change_first(ranked: list[Any], change_of: Any) -> list[Any]:
    """`ranked` (fastest first) with each fix moved after every fix it adds settings to: at each place the fastest
    fix left that adds to none of those left. The first is the fastest fix that adds to no other."""
    left, out = list(ranked), []
    while left:
        pick = next(f for f in left if not any(adds_to(change_of(f), change_of(g)) for g in left if g is not f))
        left.remove(pick)
        out.append(pick)
    return out


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
        ranked = least_change_first(ranked, lambda item: item[0][0])
        options, fixes = [], []
        for (change, why, twin), speed in ranked:
            cost = f", {speed:.0f} tokens/s ({speed / fastest:.2f} of the fastest fix)" if speed == speed else ""
            parity, parity_words = _memory_parity(frame, row, twin, curves)
            options.append(why + cost + f", {parity_words}")
            measured = {
                "tokens_per_s": speed if speed == speed else None,
                "tokens_per_s_ratio": speed / fastest if speed == speed else None,
                "peak_bytes": float(twin["peak_bytes"]),
                "against": "the fastest fix",
            }
            fixes.append(Fix(change, options[-1], [twin["cell_id"]], parity, measured))
        stage = f" at {row['oom_stage']}" if isinstance(row.get("oom_stage"), str) and row["oom_stage"] else ""
        ranking = " Ranked by throughput, fastest first." if len(fixes) > 1 else ""
        if any(adds_to(f.change, g.change) for f in fixes for g in fixes):
            ranking = " Ranked by throughput, fastest first; a fix that adds settings to another, after it."
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
    """Each ok cell with a memory setting on (8-bit optimizer, activation checkpointing, the chunked loss) beside
    its plain twin (adamw, no checkpointing, the full loss, every other axis equal): the peak it saves and the
    throughput it costs."""
    settings = _settings(frame)
    if not settings:
        return []
    ok = ok_cells(frame)
    plain = ok[ok.apply(lambda cell: _is_plain(cell, settings), axis=1)] if not ok.empty else ok
    others = [a for a in axis_names() if a in frame.columns and a not in MEMORY_SETTINGS]
    rows = []
    for _, cell in ok.iterrows():
        if _is_plain(cell, settings):
            continue
        mask = plain.index == plain.index
        for axis in others:
            mask &= plain[axis] == cell[axis]
        if not mask.any():
            continue
        base = plain[mask].iloc[0]
        names = [cell["optimizer"]] if "optimizer" in settings and cell["optimizer"] != PLAIN["optimizer"] else []
        names += ["activation checkpointing"] if bool(cell.get("activation_checkpointing")) else []
        names += [f"{cell['loss']} loss"] if "loss" in settings and cell["loss"] != PLAIN["loss"] else []
        rows.append(
            {
                "cell_id": cell["cell_id"],
                "setting": " + ".join(names),
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
