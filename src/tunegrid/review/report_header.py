"""The report's first screen: what it is of (study, date, commit, host, target), its contents, and the places the
memory estimate missed, named where they happen. The host line is also the caption of the docs' screenshots."""

from __future__ import annotations

import html
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

from tunegrid.review.run_links import CellLinks

# the estimate's accuracy goal (benchmarks/memory_estimate.py): estimate / measured peak within it
ESTIMATE_GOAL = (0.9, 1.1)
CONTENTS = (
    ("recommendations", "Recommendations"),
    ("estimate", "Memory estimate misses"),
    ("matrix", "Outcome matrix"),
    ("nan", "Non-finite events"),
    ("failures", "Other failures"),
    ("loss", "Loss curves"),
    ("memory", "Peak memory"),
    ("memory-settings", "Memory settings"),
    ("audit", "MoE quantization audit"),
    ("cells", "All cells"),
    ("probe", "Probe"),
)


def host_text(capabilities: dict[str, Any], environment: dict[str, Any]) -> str:
    """The machine that ran the study, as the probe saw it: "2-core AMD EPYC, no GPU, torch 2.13.0+cpu"."""
    cpu = capabilities.get("cpu") or {}
    cores = f"{cpu['cores']}-core " if cpu.get("cores") else ""
    gpus = [g.get("name") for g in capabilities.get("gpus") or [] if g.get("name")]
    gpu = f"{len(gpus)}x {gpus[0]}" if gpus and len(set(gpus)) == 1 else ", ".join(gpus) or "no GPU"
    torch = ((environment.get("torch") or {}).get("version")) or (capabilities.get("versions") or {}).get("torch")
    return f"{cores}{cpu.get('model') or 'unknown CPU'}, {gpu}" + (f", torch {torch}" if torch else "")


def commit_text(environment: dict[str, Any]) -> str:
    sha = environment.get("git_sha")
    if not sha:
        return "unknown (not a git checkout)"
    return str(sha)[:12] + (" with uncommitted changes" if str(sha).endswith("-dirty") else "")


def target_text(frame: Any) -> str:
    targets = sorted({str(t) for t in frame["target"].dropna()}) if "target" in frame.columns else []
    named = [t for t in targets if t != "native"]
    if not named:
        return "native (this machine)"
    return ", ".join(named) + " (a named card: costs also modelled from its data sheet)"


def header_html(
    study: str, frame: Any, capabilities: dict[str, Any], environment: dict[str, Any], counts_html: str
) -> str:
    date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    facts = [
        ("built", date),
        ("commit", commit_text(environment)),
        ("host", host_text(capabilities, environment)),
        ("target", target_text(frame)),
    ]
    dl = "".join(f"<span><b>{k}</b> {html.escape(v)}</span>" for k, v in facts)
    contents = " · ".join(f"<a href='#{anchor}'>{title}</a>" for anchor, title in CONTENTS)
    return (
        f"<header><h1>tunegrid report: {html.escape(study)}</h1><p class='facts'>{dl}</p>"
        f"<p class='counts'>{len(frame)} cells: {counts_html}</p><nav>{contents}</nav></header>"
    )


def estimate_misses(frame: Any) -> list[dict[str, Any]]:
    """Cells whose estimate / measured peak is outside the goal, one group per model and precision and
    direction: its cells and the range of peak / estimate."""
    if "estimate_over_measured" not in frame.columns:
        return []
    low, high = ESTIMATE_GOAL
    groups: dict[tuple[str, str, str], list[Any]] = defaultdict(list)
    for _, row in frame.sort_values("cell_id").iterrows():
        ratio = row["estimate_over_measured"]
        if ratio != ratio or ratio is None or low <= ratio <= high or ratio <= 0:
            continue
        side = "under" if ratio < low else "over"
        groups[(str(row["model"]), str(row["precision"]), side)].append(row)
    out = []
    for (model, precision, side), rows in groups.items():
        peaks = [1 / float(r["estimate_over_measured"]) for r in rows]
        out.append(
            {
                "group": f"{model} {precision}",  # a model in an arithmetic: what the estimate models alike
                "side": side,
                "cells": [r["cell_id"] for r in rows],
                "peak_over_estimate": (min(peaks), max(peaks)),
            }
        )
    return out


def miss_words(group: dict[str, Any]) -> str:
    low, high = group["peak_over_estimate"]
    span = f"{low:.2f}x" if round(low, 2) == round(high, 2) else f"{low:.2f}-{high:.2f}x"
    what = "peaked at" if group["side"] == "under" else "peaked at only"
    return f"{what} {span} their estimate"


def estimate_misses_html(groups: list[dict[str, Any]], links: CellLinks) -> str:
    low, high = ESTIMATE_GOAL
    goal = f"the estimate's goal is {low}-{high}x the measured peak (benchmarks/memory_estimate.py)"
    if not groups:
        return f"<p class='none'>None: every cell's estimate is within {low}-{high}x its measured peak.</p>"
    items = "".join(
        f"<li class='miss'><b>{html.escape(g['group'])}</b>: {len(g['cells'])} "
        f"cell(s) {miss_words(g)} ({'under' if g['side'] == 'under' else 'over'}-estimated): "
        f"{links.cells(g['cells'])}</li>"
        for g in groups
    )
    return (
        f"<ul>{items}</ul><p class='cite'>Outside {goal}. An under-estimate plans a cell that may not fit; the "
        "all-cells table marks each such cell.</p>"
    )
