"""The doctor's verdicts: after each try of the second wave, whether a fix of the baseline now holds (the
ordinary summary and recommender over the cells run so far), and at the end the answer on one screen: the
failure, its cause, the fix, its cost (peak, tokens/s, the cell-minutes the doctor spent), the evidence cells,
the fix as the user's own recipe, the report's path. Every cell is an ordinary cell: its result.json, its
MLflow run, its row in the doctor's summary and report.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunegrid.review.doctor_choice import DETERMINISTIC, NOT_REPRODUCED, TRANSIENT, result_row, tokens_run
from tunegrid.runtime.files import atomic_write_text, read_json, read_jsonl, write_json
from tunegrid.study.config import Cell
from tunegrid.study.paths import StudyPaths
from tunegrid.units import human_bytes
from tunegrid.vocabulary import parse_cell_id


@dataclass
class Verdict:
    recommendations: list[dict[str, Any]]
    fixes: list[dict[str, Any]]  # the fixes of the baseline, each with the cell that is the baseline with it
    rows: dict[str, dict[str, Any]]  # the summary row of each cell judged, by id

    @property
    def holds(self) -> bool:
        return bool(self.fixes)


def baseline_fixes(baseline_id: str, recommendations: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every fix offered for the baseline whose own twin (the baseline with the change) is among its evidence,
    in the recommender's order: the first is the recommendation."""
    baseline = parse_cell_id(baseline_id)
    found = []
    for rec in recommendations:
        if baseline_id not in rec["failing"] + rec["concerns"]:
            continue
        for fix in rec["fixes"]:
            if not set(fix["change"]) <= set(baseline):
                continue
            cell_id = Cell(**{**baseline, **fix["change"]}).cell_id
            if cell_id in fix["evidence"]:
                found.append({**fix, "cell_id": cell_id, "recommendation": rec["text"], "title": rec["title"]})
    return found


def verdict_of(study: dict[str, Any], baseline_id: str, results: list[Path], capabilities: dict[str, Any]) -> Verdict:
    """The recommender over these cells alone, as the grid's report runs it over all of them."""
    from tunegrid.review.recommend import recommend
    from tunegrid.review.summary import build_summary

    frame = build_summary(results, review=study["review"])
    curves = {read_json(p)["cell_id"]: read_jsonl(p.parent / "metrics.jsonl") for p in results}
    recs = [r.as_dict() for r in recommend(frame, capabilities, curves)]
    rows = {str(r["cell_id"]): {k: (None if v != v else v) for k, v in r.items()} for r in frame.to_dict("records")}
    return Verdict(recs, baseline_fixes(baseline_id, recs), rows)


def cell_minutes(results: list[Path]) -> float:
    return sum(float(read_json(p).get("wall_s") or 0.0) for p in results) / 60.0


def _failure_line(reproduced: dict[str, Any], baseline: str, repeat: str) -> str:
    text = _signature_text(reproduced["baseline"])
    if reproduced["verdict"] == DETERMINISTIC:
        return f"{text} — deterministic: the same again in {repeat} (same seed)"
    again = _signature_text(reproduced["repeat"])
    return f"{text} in {baseline}; its same-seed re-run {repeat} ended {again} — transient"


def _signature_text(found: dict[str, Any]) -> str:
    """`nan at step 0 (loss_nonfinite), origin layers.0.mlp.down_proj`; an out-of-memory failure at its stage."""
    kind = f" ({found['kind']})" if found.get("kind") else ""
    step = found.get("step")
    where = "" if step is None else f" at step {step}" if isinstance(step, int) else f" at stage {step}"
    return f"{found['outcome']}{where}{kind}, origin {found.get('origin') or 'unknown'}"


def _cause(text: str, limit: int = 320) -> str:
    """A recommendation's words before its fixes and its ranking note: what failed, where, and why."""
    cause = text.split(" Fix:")[0].split(" Ranked by ")[0].strip()
    return cause if len(cause) <= limit else cause[: limit - 1].rstrip() + "…"


def _export(study: dict[str, Any], fix_cell: str, out_dir: Path) -> str:
    """The fix as the user's own recipe file (an imported study), else the study setting to change."""
    from tunegrid.recipes.export import _family, export_cell
    from tunegrid.study.errors import ConfigError

    base = study.get("base") or {}
    if not base.get("recipe"):
        return "the study was not imported from a recipe: run the fix cell's settings (its id names them)"
    try:
        done = export_cell(study, fix_cell, _family(base.get("from") or "axolotl"))
    except ConfigError as exc:
        return f"not exported: {exc}"
    path = out_dir / f"fix-{fix_cell}{Path(base['recipe']).suffix or '.yaml'}"
    atomic_write_text(path, done.text)
    changed = ", ".join(f"{k}: {v}" for k, v in done.keys.items()) or "nothing"
    return f"{path} (your {done.tool} file with {changed})"


def _cost(row: dict[str, Any], spent: float, cells: int) -> str:
    peak = human_bytes(row["peak_bytes"]) if row.get("peak_bytes") else "not measured"
    speed = f"{row['tokens_per_s']:.0f} tokens/s" if row.get("tokens_per_s") else "tokens/s not measured"
    modelled = (
        f"; {row['modelled_step_s'] * 1e3:.3g} ms/step modelled on {row.get('target')}"
        if row.get("modelled_step_s")
        else ""
    )
    here = " on this machine" if modelled else ""
    return f"peak {peak}, {speed}{here}{modelled}; the doctor spent {spent:.2f} cell-minutes on {cells} cells"


def _ranking(text: str) -> str | None:
    """A recommendation's sentence on how its fixes were ranked (by the target's modelled cost, or measured)."""
    if " Ranked by " not in text:
        return None
    sentence = "Ranked by " + text.split(" Ranked by ", 1)[1]
    return re.split(r"(?<=[.])\s+(?=[A-Z])", sentence, maxsplit=1)[0]  # up to the notes after it


def conclude(
    paths: StudyPaths,
    study: dict[str, Any],
    baseline_id: str,
    mode: str,
    reproduced: dict[str, Any],
    choice: dict[str, Any],
    tried: list[list[str]],
    capabilities: dict[str, Any],
    environment: dict[str, Any],
    out_dir: Path,
    not_run: list[str] | None = None,
) -> dict[str, Any]:
    """doctor.json, screen.txt, the doctor's summary and report in `out_dir`; returns doctor.json's content.
    `not_run`: the candidates the second wave ended before, each with why it was not needed."""
    from tunegrid.review.report import build_report
    from tunegrid.review.summary import write_summary

    repeat_id = reproduced.get("repeat_cell") or ""
    ran = [baseline_id, *([repeat_id] if repeat_id else [])]
    ran += [cell for group in tried for cell in group if cell not in ran]
    results = [paths.result(cell) for cell in ran]
    write_summary(results, out_dir / "summary.csv", review=study["review"])
    build_report(out_dir / "summary.parquet", results, capabilities, environment, out_dir / "report", study["study"])
    spent = cell_minutes(results)
    record: dict[str, Any] = {
        "study": study["study"],
        "baseline": baseline_id,
        "mode": mode,
        "reproduction": reproduced,
        "choice": choice,
        "tries": tried,
        "cells": ran,
        "cell_minutes": spent,
        "report": str(out_dir / "report" / "index.html"),
        "fix": None,
        "not_run": list(not_run or []),
    }
    base_row = result_row(paths.result(baseline_id))
    lines = [f"tunegrid doctor: {study['study']} / {baseline_id}"]
    if reproduced["verdict"] == NOT_REPRODUCED:
        steps, tokens = base_row.get("steps_run") or 0, tokens_run(paths.run_dir(baseline_id))
        record["answer"] = NOT_REPRODUCED
        lines += [
            f"failure:  not reproduced: {baseline_id} ran ok for {steps} steps ({tokens} tokens)",
            "next:     run more steps (tunegrid doctor --steps N), another seed (grid.seed), the recipe's own data "
            "and sequence length, or the target it failed on (hardware.target)",
            f"cost:     {_cost(base_row, spent, len(ran))}",
        ]
    elif reproduced["verdict"] == TRANSIENT:
        record["answer"] = TRANSIENT
        lines += [
            f"failure:  {_failure_line(reproduced, baseline_id, repeat_id)}",
            "cause:    not the recipe: the same cell, seed and data did not fail the same way twice (a host, "
            "device or network fault)",
            "next:     re-run it; train.checkpoint_every lets a run resume after such a fault; check the host "
            "(memory errors, other jobs, the interconnect)",
            f"evidence: {baseline_id}, {repeat_id}",
            f"cost:     the doctor spent {spent:.2f} cell-minutes on {len(ran)} cells",
        ]
    else:
        verdict = verdict_of(study, baseline_id, results, capabilities)
        record["recommendations"] = verdict.recommendations
        lines.append(f"failure:  {_failure_line(reproduced, baseline_id, repeat_id)}")
        about = [r for r in verdict.recommendations if baseline_id in r["failing"] + r["concerns"]]
        if about:
            lines.append(f"cause:    {_cause(about[0]['text'])}")
        if verdict.holds:
            fix = verdict.fixes[0]
            record["fix"] = fix
            record["answer"] = "fixed"
            fix_row = result_row(paths.result(fix["cell_id"]))
            change = ", ".join(f"{k}={v}" for k, v in fix["change"].items())
            ranked = _ranking(fix["recommendation"])
            lines += [
                f"fix:      {change} — {fix['why']}",
                *([f"ranked:   {ranked}"] if ranked else []),
                f"cost:     {_cost(fix_row, spent, len(ran))}",
                *([f"not run:  {'; '.join(not_run)}"] if not_run else []),
                *([f"ruled out: {'; '.join(choice['skipped'])}"] if choice.get("skipped") else []),
                f"evidence: {', '.join(fix['evidence'])}",
                f"recipe:   {_export(study, fix['cell_id'], out_dir)}",
            ]
            others = [f"{', '.join(f'{k}={v}' for k, v in f['change'].items())}" for f in verdict.fixes[1:]]
            if others:
                lines.append(f"also:     {'; '.join(others)} (ranked after it; see the report)")
        else:
            record["answer"] = "no fix held"
            tried_cells = [c for group in tried for c in group]
            lines += [
                f"fix:      none held among {len(tried_cells)} cells tried ({', '.join(tried_cells) or 'none'})",
                "ruled out: " + ("; ".join(choice["skipped"]) or "nothing"),
                f"cost:     the doctor spent {spent:.2f} cell-minutes on {len(ran)} cells",
                "next:     run the study's full grid (snakemake all) for fixes outside these tables",
            ]
    lines.append(f"report:   {record['report']}")
    record["screen"] = lines
    write_json(out_dir / "doctor.json", record)
    atomic_write_text(out_dir / "screen.txt", "\n".join(lines) + "\n")
    return record


def try_verdict(
    paths: StudyPaths,
    study: dict[str, Any],
    baseline_id: str,
    cells: list[str],
    new: list[str],
    capabilities: dict[str, Any],
    out: Path,
    choice: dict[str, Any] | None = None,
    first: bool = False,
) -> dict[str, Any]:
    """One try's file: its own cells (`new`), whether a fix of the baseline holds among all run so far, and
    whether the second wave stops here (`stop`: `first` at a fix that holds, else once no candidate left can rank
    above it), with why each candidate left is not needed, and the candidates the tries after it pass over."""
    from tunegrid.review.doctor_stop import passed_over, stop

    verdict = verdict_of(study, baseline_id, [paths.result(c) for c in cells], capabilities)
    choice = choice or {"candidates": []}
    done, not_run = stop(choice, verdict.fixes, verdict.rows, cells, first)
    record = {
        "cells": cells,
        "new": new,
        "holds": verdict.holds,
        "fixes": verdict.fixes,
        "stop": done,
        "not_run": not_run,
        "passed": sorted(passed_over(choice, verdict.fixes, cells)),  # the next tries skip these
    }
    atomic_write_text(out, json.dumps(record, indent=1, default=str) + "\n")
    return record
