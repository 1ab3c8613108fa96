"""The study at a glance, for the last lines of `snakemake … all`: outcome counts, the failing cells'
one-line reasons grouped, and where the report is. Read from the cells' result.json files only (no
mlflow, no torch), so the Snakefile's onsuccess hook prints it in well under a second, after every cell.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tunegrid.vocabulary import Outcome

SHOWN_CELLS = 3  # cell ids named per group of failures; the rest are counted
NUMBER_RE = re.compile(r"\d+(?:\.\d+)?")


def _signature(reason: str) -> str:
    """A reason with its numbers blanked: cells failing the same way at different steps group together."""
    return NUMBER_RE.sub("#", reason)


def _grouped_reason(reasons: list[str]) -> str:
    """One line for reasons that differ only in their numbers: a number every cell shares as it is; one that
    differs, each cell's own in the order the cells are named (`5/7`) while all are named, else its range
    (`3..9`), so no cell's figure reads as another's."""
    if len(reasons) == 1:
        return reasons[0]
    numbers = [NUMBER_RE.findall(reason) for reason in reasons]
    pieces = NUMBER_RE.split(reasons[0])
    line = pieces[0]
    for position, piece in enumerate(pieces[1:]):
        values = [found[position] for found in numbers]
        if len(set(values)) == 1:
            shown = values[0]
        elif len(values) <= SHOWN_CELLS:
            shown = "/".join(values)
        else:
            low, high = min(values, key=float), max(values, key=float)
            shown = f"{low}..{high}"
        line += shown + piece
    return line


def glance(study: str, study_dir: Path, cell_ids: list[str]) -> list[str]:
    """The lines to print; empty when no cell of the study has a result yet (e.g. after `plan`)."""
    results = {}
    for cell_id in cell_ids:
        path = study_dir / "runs" / cell_id / "result.json"
        try:
            results[cell_id] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    if not results:
        return []
    counts: dict[str, int] = {}
    groups: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for cell_id, result in results.items():
        outcome = str(result.get("outcome", "error"))
        counts[outcome] = counts.get(outcome, 0) + 1
        if outcome != Outcome.OK:
            reason = " ".join(str(result.get("reason", "")).split())
            groups.setdefault((outcome, _signature(reason)), []).append((cell_id, reason))
    order = sorted(counts, key=lambda o: (o != Outcome.OK, -counts[o], o))
    missing = len(cell_ids) - len(results)
    head = f"tunegrid study {study!r}: {len(results)} cells: " + ", ".join(f"{counts[o]} {o}" for o in order)
    lines = [head + (f" ({missing} without a result)" if missing else "")]
    for (outcome, _), cells in sorted(groups.items(), key=lambda item: (item[0][0], -len(item[1]))):
        named = ", ".join(cell for cell, _ in cells[:SHOWN_CELLS])
        more = f" and {len(cells) - SHOWN_CELLS} more" if len(cells) > SHOWN_CELLS else ""
        reason = _grouped_reason([reason for _, reason in cells])
        lines.append(f"  {outcome} x{len(cells)}: {reason[:200]} [{named}{more}]")
    report = study_dir / "report" / "index.html"
    if report.is_file():
        lines.append(f"report: {report}")
    return lines
