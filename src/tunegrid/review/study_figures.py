"""The figures the docs quote from a finished study, from its files only (summary.csv, recommendations.json, the
probe and environment records): the host and commit that made them, the outcome counts and each recommendation's
fix table (the rows the report shows, review/fix_table.py). The screenshots command records them beside the
pictures (screenshots.json) and writes the review guide's generated block from them, so the guide, the pictures
and a study run cannot disagree: a test regenerates the figures from a fresh run and compares them."""

from __future__ import annotations

import csv
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tunegrid.review.fix_table import fix_rows, parity_text
from tunegrid.review.report_header import commit_text, host_text
from tunegrid.runtime.files import read_json

BLOCK_START = "<!-- figures: written by `python scripts/tunegrid.py screenshots` from results/default; do not edit -->"
BLOCK_END = "<!-- end of the generated figures -->"
SHOWN_CELLS = 2  # evidence cells named in the guide's table; the report links every one


def study_figures(study_dir: Path) -> dict[str, Any]:
    with open(study_dir / "summary.csv", newline="") as fh:
        summary = list(csv.DictReader(fh))
    quality = {row["cell_id"]: row.get("quality") or None for row in summary}
    recs = read_json(study_dir / "report" / "recommendations.json")
    made = datetime.fromtimestamp((study_dir / "summary.csv").stat().st_mtime, UTC)
    return {
        "study": study_dir.resolve().name,
        "host": host_text(read_json(study_dir / "probe" / "capabilities.json"), _environment(study_dir)),
        "commit": commit_text(_environment(study_dir)),
        "date": made.strftime("%Y-%m-%d"),
        "cells": len(summary),
        "outcomes": dict(sorted(Counter(row["outcome"] for row in summary).items())),
        "recommendations": [
            {
                "signature": rec["signature"],
                "title": rec["title"],
                "failing": rec["failing"],
                "fixes": [
                    {**row, "parity": None if row["parity"] is None else round(row["parity"], 4)}
                    for row in fix_rows(rec, quality)
                ],
            }
            for rec in recs
        ],
    }


def _environment(study_dir: Path) -> dict[str, Any]:
    path = study_dir / "env" / "environment.json"
    return read_json(path) if path.is_file() else {}


def _cells(cells: list[str]) -> str:
    shown = ", ".join(f"`{c}`" for c in cells[:SHOWN_CELLS])
    return shown + (f" and {len(cells) - SHOWN_CELLS} more" if len(cells) > SHOWN_CELLS else "")


def guide_block(figures: dict[str, Any]) -> str:
    """The review guide's block of figures (markdown), between its markers."""
    counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(figures["outcomes"].items(), key=lambda i: -i[1]))
    lines = [
        BLOCK_START,
        "",
        f"The default study as the screenshots show it: {figures['cells']} cells ({counts}), run on "
        f"{figures['date']} at commit `{figures['commit']}` on a {figures['host']}. The tokens/s ratios are that "
        "host's and move with the CPU (another host may rank the fixes otherwise); the fixes, their evidence and "
        "their loss parity do not.",
    ]
    for rec in figures["recommendations"]:
        failing = f" (failing: {_cells(rec['failing'])})" if rec["failing"] else ""
        lines += ["", f"**{rec['title']}**{failing}", ""]
        if not rec["fixes"]:
            lines.append("A finding: no fix the grid shows working.")
            continue
        lines += ["| fix | holds | loss parity | cost (against) | evidence |", "|---|---|---|---|---|"]
        for fix in rec["fixes"]:
            against = f" of {fix['against']}" if fix["against"] else ""
            lines.append(
                f"| {fix['fix']} | {fix['holds']} | {parity_text(fix['parity'])} | {fix['cost']}{against} | "
                f"{_cells(fix['evidence'])} |"
            )
    return "\n".join([*lines, "", BLOCK_END])


def replace_block(text: str, block: str) -> str:
    """The page with its generated block replaced; a page without the markers is refused."""
    start, end = text.find(BLOCK_START), text.find(BLOCK_END)
    if start < 0 or end < start:
        raise ValueError("the page has no generated block of figures (its markers are missing)")
    return text[:start] + block + text[end + len(BLOCK_END) :]


def block_of(text: str) -> str:
    start, end = text.find(BLOCK_START), text.find(BLOCK_END)
    return text[start : end + len(BLOCK_END)] if 0 <= start < end else ""
