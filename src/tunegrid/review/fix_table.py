"""A recommendation as the report shows it: the finding in one sentence, then one row per fix (the change, how
many of its evidence cells hold, its loss parity, its cost against the baseline it names, the evidence cells) in
the order recommended, and the notes the fixes do not already say. The rows are data first (`fix_rows`, from a
recommendation as recommendations.json holds it and the summary's quality column), so the review guide's generated
block and the tests read the same figures the page shows."""

from __future__ import annotations

import html
import re
from typing import Any

from tunegrid.review.quality import HOLDS, NO_REFERENCE
from tunegrid.review.run_links import CellLinks
from tunegrid.units import human_bytes

# sentences the table already says: the fixes themselves and their order
SAID_BY_THE_TABLE = ("Fix:", "Ranked by", "Each of these")
SENTENCE_END = re.compile(r"(?<=[.])\s+(?=[A-Z])")
STAGE_PEAKS = (("load_peak_bytes_ratio", "load peak"), ("first_step_peak_bytes_ratio", "first-step peak"))
FIX_COLUMNS = ("fix", "holds", "parity", "cost", "evidence")


def change_text(change: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in change.items())


def failing_setting(rec: dict[str, Any]) -> str:
    """What a precision fix's baseline stands for: the failing setting in the signature (nan:fp16 -> fp16)."""
    return rec["signature"].split(":", 1)[1] if ":" in rec["signature"] else rec["signature"]


def cost_text(rec: dict[str, Any], cost: dict[str, Any] | None) -> tuple[str, str | None]:
    """(the cost in a few words, the baseline it is measured against: a setting or a cell), "not measured" where
    the rule measured none."""
    if not cost:
        return "not measured", None
    against = cost.get("against")
    if isinstance(against, str) and against.startswith("itself"):
        return f"1.00x: the baseline (its cells stand for {failing_setting(rec)}'s, which ran no timed step)", None
    parts = []
    if cost.get("modelled_tokens_per_s_ratio") is not None:
        parts.append(
            f"{cost['modelled_tokens_per_s_ratio']:.2f}x tokens/s of {cost.get('modelled_against')} modelled on "
            f"{cost.get('target')}; measured here:"
        )
    if cost.get("tokens_per_s_ratio") is not None:
        parts.append(f"{cost['tokens_per_s_ratio']:.2f}x tokens/s")
    if cost.get("peak_bytes_ratio") is not None:
        parts.append(f"{cost['peak_bytes_ratio']:.2f}x peak")
    parts += [f"{cost[key]:.2f}x {what}" for key, what in STAGE_PEAKS if cost.get(key) is not None]
    if cost.get("peak_bytes") is not None and cost.get("peak_bytes_ratio") is None:
        parts.append(f"peak {human_bytes(cost['peak_bytes'])}")
    if not parts:
        return "not measured", None
    return " ".join(p if p.endswith(":") else p + "," for p in parts).rstrip(","), against


def _holds(evidence: list[str], quality: dict[str, Any]) -> str:
    """How many of the evidence cells hold (learned and matched the reference); a memory fix may cite a cell that
    learned with no reference to match."""
    held = sum(quality.get(c) == HOLDS for c in evidence)
    unreferenced = sum(quality.get(c) == NO_REFERENCE for c in evidence)
    text = f"{held} of {len(evidence)}"
    return text + (f" ({unreferenced} learned, no reference)" if unreferenced else "")


def fix_rows(rec: dict[str, Any], quality: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per fix, in the order recommended: fix, holds, parity (the largest loss deviation of its evidence
    from the reference, a fraction), cost and its baseline, evidence; `quality` is summary.csv's cell -> quality."""
    rows = []
    for fix in rec.get("fixes") or []:
        cost, against = cost_text(rec, fix.get("cost"))
        rows.append(
            {
                "fix": change_text(fix["change"]),
                "why": fix["why"],
                "holds": _holds(fix["evidence"], quality),
                "parity": fix.get("parity"),
                "cost": cost,
                "against": against,
                "evidence": list(fix["evidence"]),
            }
        )
    return rows


def lead_and_notes(text: str) -> tuple[str, list[str]]:
    """The recommendation's first sentence (what failed, where) and the sentences the table does not say."""
    sentences = [s for s in SENTENCE_END.split(text.strip()) if s]
    if not sentences:
        return "", []
    return sentences[0], [s for s in sentences[1:] if not s.startswith(SAID_BY_THE_TABLE)]


def parity_text(parity: Any) -> str:
    return f"within {parity:.1%}" if isinstance(parity, float) and parity == parity else "not compared"


def _fix_table_html(rows: list[dict[str, Any]], links: CellLinks) -> str:
    head = (
        "<th>fix</th><th title='evidence cells that learned and matched their reference twin'>holds</th>"
        "<th title='largest loss deviation of the evidence from its reference twin'>loss parity</th>"
        "<th>cost (against)</th><th>evidence (MLflow runs)</th>"
    )
    body = []
    for rank, row in enumerate(rows):
        against = row["against"]
        named = links.cell(against) if against in links.runs else html.escape(str(against))
        cost = html.escape(row["cost"]) + (f" <span class='against'>of {named}</span>" if against else "")
        first = " class='first'" if rank == 0 else ""
        body.append(
            f"<tr{first}><td title='{html.escape(row['why'])}'><b>{html.escape(row['fix'])}</b></td>"
            f"<td>{html.escape(row['holds'])}</td><td>{parity_text(row['parity'])}</td><td>{cost}</td>"
            f"<td class='cells'>{links.cells(row['evidence'], '<br>')}</td></tr>"
        )
    return f"<table class='fixes'><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def recommendations_html(recs: list[dict[str, Any]], quality: dict[str, Any], links: CellLinks) -> str:
    if not recs:
        return "<p class='none'>No failure in this grid has a fix that the grid itself shows working.</p>"
    items = []
    for number, rec in enumerate(recs, 1):
        lead, notes = lead_and_notes(rec["text"])
        rows = fix_rows(rec, quality)
        named = rec["failing"] or rec["concerns"]
        who = f"<p class='who'>{'failing' if rec['failing'] else 'concerns'}: {links.cells(named)}</p>" if named else ""
        table = (
            _fix_table_html(rows, links)
            + "<p class='cite'>Each row is a fix on its own, in the order recommended (the first row); hover a fix "
            "for its reasoning.</p>"
            if rows
            else "<p class='none'>A finding: no fix the grid shows working.</p>"
        )
        listed = "".join(f"<li>{html.escape(n)}</li>" for n in notes)
        items.append(
            f"<div class='rec' id='rec-{number}'><h3>{html.escape(rec['title'])}</h3>"
            f"<p>{html.escape(lead)}</p>{who}{table}"
            + (f"<ul class='notes'>{listed}</ul>" if listed else "")
            + "</div>"
        )
    return "".join(items)
