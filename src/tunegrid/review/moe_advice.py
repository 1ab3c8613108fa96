"""Advice on MoE memory: fused experts that plain 4-bit loading left in full precision, and the
load peaks that quantizing them as they load brought down. The twin that quantized the experts is cited as a
fix only where its quality holds (review/quality.py: it learned and matched its reference twin within tolerance);
an ok twin that did not is named as no evidence of a fix, and the finding stands without a fix.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from tunegrid.meanings import QUANT_ROWS
from tunegrid.review.advice import (
    Fix,
    Recommendation,
    holds,
    no_evidence,
    number,
    parity_of,
    parity_text,
    siblings,
    unproven_name,
)
from tunegrid.units import human_bytes
from tunegrid.vocabulary import Outcome, Quant

# quantizations that quantize the fused experts too (nf4-experts, int8-experts), from their rows
EXPERT_QUANTS = [p.quant for p in QUANT_ROWS.values() if p.experts_quantized]
EXPERT_GAP_SHARE = 0.2  # experts left unquantized worth more than this share of the weights is a gap


def expert_gap(frame: Any) -> list[Recommendation]:
    """One recommendation per model: plain-4-bit (8-bit) cells with unquantized experts vs their nf4-experts
    (int8-experts) twins."""
    if "quant" not in frame.columns:
        return []
    return [_recommendation(model, members) for model, members in _expert_pairs(frame).items()]


def _expert_pairs(frame: Any) -> dict[str, list[tuple[Any, Any]]]:
    """By model: each cell that left its experts unquantized, with its first ok twin that quantized them too."""
    leaves_experts = [p.quant for p in QUANT_ROWS.values() if p.quantizes and not p.experts_quantized]
    gap = frame[
        frame["quant"].isin(leaves_experts)
        & (frame["flagged_share"].fillna(0) >= EXPERT_GAP_SHARE)
        & frame["expert_bytes"].notna()
    ]
    pairs: dict[str, list[tuple[Any, Any]]] = defaultdict(list)
    for _, row in gap.iterrows():
        fixed = siblings(frame, row, "quant")
        bits = QUANT_ROWS[Quant(row["quant"])].bits  # nf4 -> nf4-experts, int8 -> int8-experts
        twins = [q for q in EXPERT_QUANTS if QUANT_ROWS[q].bits == bits]
        fixed = fixed[fixed["quant"].isin(twins) & (fixed["outcome"] == Outcome.OK)]
        if not fixed.empty:
            pairs[row["model"]].append((row, fixed.iloc[0]))
    return pairs


def _recommendation(model: str, members: list[tuple[Any, Any]]) -> Recommendation:
    row, sib = members[0]
    bits = QUANT_ROWS[Quant(row["quant"])].bits
    failed = [r for r, _ in members if r["outcome"] != Outcome.OK]
    # the goal is memory: recommend only where the twins' peaks show it (or a plain-4-bit cell failed
    # and its twin ran)
    peaks_fell = all(
        number(s["peak_bytes"]) < number(r["peak_bytes"]) for r, s in members if r["outcome"] == Outcome.OK
    )
    text = _gap_text(members, bits, failed)
    proven = [s for _, s in members if holds(s)]
    unproven = [unproven_name(s) for _, s in members if not holds(s)]
    evidence = sorted(s["cell_id"] for s in proven)
    if unproven:
        text += " " + no_evidence(f"quant={sib['quant']}", unproven)
    fixes = []
    if peaks_fell or failed:
        title = f"{model}: experts not quantized by plain {bits}-bit"
        if proven:
            fixes = [_quantize_fix(sib, proven, evidence)]
    else:
        title = f"{model}: {sib['quant']} shrinks the weights, but the peaks did not fall here"
        text += " Not recommended for memory on this machine: the whole-process peak is set by something else here."
    return Recommendation(
        signature="moe_expert_gap",
        title=title,
        text=text,
        failing=sorted(r["cell_id"] for r in failed),
        evidence=evidence,
        fixes=fixes,
        concerns=sorted(r["cell_id"] for r, _ in members),
    )


def _gap_text(members: list[tuple[Any, Any]], bits: int | None, failed: list[Any]) -> str:
    """What plain loading left in full precision, and what the twins measured: weights and peaks."""
    row, sib = members[0]
    shares = [float(r["flagged_share"]) for r, _ in members]
    peak_pairs = [
        f"{human_bytes(r['peak_bytes'])} -> {human_bytes(s['peak_bytes'])} ({r['precision']}, bs "
        f"{int(r['batch_size'])})"
        for r, s in members
    ]
    text = (
        f"Plain {bits}-bit loading left {int(row['flagged_tensors'])} tensor(s) in full precision: "
        f"{min(shares):.0%}-{max(shares):.0%} of the weight bytes. bitsandbytes only replaces nn.Linear, and "
        f"transformers v5 keeps fused experts as 3-D parameters. quant={sib['quant']} cut the weights from "
        f"{human_bytes(row['weight_bytes'])} to {human_bytes(sib['weight_bytes'])} ({row['cell_id']} vs "
        f"{sib['cell_id']}); "
        f"measured peaks: " + "; ".join(peak_pairs) + "."
    )
    if failed:
        text = (
            "; ".join(f"{r['cell_id']} ended {r['outcome']}" for r in failed)
            + f", its {sib['quant']} twin was ok. "
            + text
        )
    return text


def _quantize_fix(sib: Any, proven: list[Any], evidence: list[str]) -> Fix:
    """Quantize the experts too, judged by the twin whose loss lies furthest from its reference."""
    worst = max(proven, key=lambda s: parity_of(s) or 0.0)
    parities = [p for p in (parity_of(s) for s in proven) if p is not None]
    shown = parity_text(worst)
    return Fix(
        {"quant": sib["quant"]},
        "quantize the experts too" + (f" ({shown})" if shown else ""),
        evidence,
        max(parities) if parities else None,
    )


def load_peaks(row: Any, fixed: Any) -> str:
    """For an OOM at load that the experts quantized as they load fixed: both load peaks, as measured."""
    at_load = row.get("oom_stage") == "load" and number(row.get("oom_peak_bytes")) < float("inf")
    if not at_load or fixed["quant"] not in EXPERT_QUANTS:
        return ""
    failed = human_bytes(row["oom_peak_bytes"])
    return f"; load peak {human_bytes(fixed['load_peak_bytes'])}, where {row['quant']} failed at {failed}"
