"""The study's comparison report: one self-contained HTML page plus the PNGs it embeds. Built from the files
(summary.parquet, each cell's result.json and metrics.jsonl, the probe record), never from MLflow, so it can be
rebuilt with the store down. Opens from disk: images are inlined."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

from tunegrid.cell_view import CellView
from tunegrid.columns import COLUMNS, audit_cells
from tunegrid.outcome import CellResult
from tunegrid.recipes.export import fixes_html
from tunegrid.review.fix_table import recommendations_html
from tunegrid.review.memory_advice import memory_setting_rows
from tunegrid.review.plots import OUTCOME_COLOURS, plot_losses, plot_memory, plot_outcomes
from tunegrid.review.recommend import recommend
from tunegrid.review.report_format import fmt, missing, table
from tunegrid.review.report_header import ESTIMATE_GOAL, estimate_misses, estimate_misses_html, header_html
from tunegrid.review.run_links import CellLinks, mlflow_note, mlflow_run_base
from tunegrid.review.stack_advice import stack_facts
from tunegrid.runtime.files import atomic_write_text, read_json, read_jsonl
from tunegrid.study.paths import StudyPaths
from tunegrid.units import human_bytes
from tunegrid.vocabulary import Outcome, axis_names


def _png(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


NAN_COLUMNS = [
    "cell_id",
    "nan_step",
    "nan_kind",
    "nan_forward_module",
    "nan_backward_module",
    "fp16_headroom_worst_module",
    "fp16_headroom_worst_ratio",
]
AUDIT_COLUMNS = ["cell", *(c.label for c in COLUMNS if c.label is not None)]
MEMORY_SETTING_COLUMNS = [
    "cell_id",
    "setting",
    "plain cell",
    "peak_bytes",
    "peak / plain",
    "tokens/s / plain",
    "optimizer_state_bytes",
    "estimate_over_measured",
    "final loss - plain",
]
# the quality columns (loss_fall, quality, loss_deviation) and fp32_islands: review/quality.py,
# cell/nonfinite/islands.py;
# the cell name links to its MLflow run, the figures to compare come first and the long reason last
ALL_CELLS_COLUMNS = """cell_id outcome final_loss quality loss_deviation peak_bytes estimate_over_measured tokens_per_s
loss_fall effective_batch steps_run resumed_from_step skipped_steps quality_note fp32_islands optimizer_state_bytes
collective_diagnosis straggler_rank slow_link_ratio collective_parted reason""".split()


def _any_value(frame: Any, column: str) -> bool:
    """A column to show: present and set for some cell (a grid without ranks has no collective columns)."""
    return column in frame.columns and bool(frame[column].notna().any())


def _probe_facts(capabilities: dict[str, Any], environment: dict[str, Any], results: Any = None) -> list[Any]:
    facts = [
        {"fact": "device", "value": capabilities.get("device")},
        {
            "fact": "precision support",
            "value": ", ".join(f"{k}: {v}" for k, v in (capabilities.get("precision") or {}).items()),
        },
        {
            "fact": "matmul TFLOP/s",
            "value": ", ".join(f"{k}: {v:.3g}" for k, v in (capabilities.get("matmul_tflops") or {}).items() if v),
        },
        {"fact": "memory bandwidth GB/s", "value": capabilities.get("memory_bandwidth_gbs")},
    ]
    for world, rec in (capabilities.get("allreduce") or {}).items():
        if isinstance(rec, dict) and rec.get("sizes"):
            best = max(rec["sizes"], key=lambda s: s["busbw_gbs"])
            backend = f" ({rec['backend']})" if rec.get("backend") else ""
            facts.append(
                {
                    "fact": f"all-reduce bus bandwidth, world {world}{backend}",
                    "value": f"{best['busbw_gbs']:.3g} GB/s at {human_bytes(best['bytes'])}",
                }
            )
    for gpu in capabilities.get("gpus") or []:
        facts.append(
            {
                "fact": f"GPU {gpu.get('index', '')}",
                "value": f"{gpu.get('name')} cc {gpu.get('compute_capability')} "
                f"{gpu.get('total_bytes', 0) / 2**30:.1f} GiB",
            }
        )
    packages = environment.get("packages") or {}
    facts.append(
        {
            "fact": "versions",
            "value": ", ".join(
                f"{k} {v}"
                for k, v in packages.items()
                if k in ("torch", "transformers", "peft", "bitsandbytes", "mlflow")
            ),
        }
    )
    return facts + stack_facts(results or {})  # and a line per library stack the cells ran on


def _audit_rows(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The MoE cells' rows of the audit table: the cell, then the column table's labelled columns."""
    rows = []
    for cell_id, result in sorted(results.items()):
        view = CellView(CellResult.from_json(result), {})
        if (view.final_audit.get("by_role") or {}).get("experts"):
            rows.append({"cell": cell_id, **audit_cells(view)})
    return rows


def _log_tail(path: Path, lines: int = 12) -> str:
    """The last lines of a cell's log, progress-bar redraws collapsed to their final state."""
    if not path.is_file():
        return ""
    text = path.read_text(errors="replace").replace("\r", "\n")
    kept = [line for line in text.splitlines() if line.strip()]
    return "\n".join(kept[-lines:])


def failure_groups(frame: Any, results: dict[str, dict[str, Any]], logs_dir: Path) -> list[dict[str, Any]]:
    """Cells that ended neither ok nor nan, one group per distinct cause: the reason once, the cells it
    hit, the end of one cell's traceback (or log) and the log's path."""
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for row in frame[~frame["outcome"].isin([Outcome.OK, Outcome.NAN])].sort_values("cell_id").to_dict("records"):
        key = (str(row["outcome"]), str(row["reason"]))
        group = groups.setdefault(key, {"outcome": key[0], "reason": key[1], "cells": []})
        group["cells"].append(row["cell_id"])
    for group in groups.values():
        first = group["cells"][0]
        log_path = logs_dir / f"{first}.log"
        traceback = (results.get(first) or {}).get("traceback") or ""
        group.update(
            log_path=str(log_path),
            log_tail=_log_tail(log_path),
            traceback_tail="\n".join(traceback.strip().splitlines()[-6:]),
        )
    return sorted(groups.values(), key=lambda g: (-len(g["cells"]), g["outcome"], g["reason"]))  # widest cause first


def _failures_html(groups: list[dict[str, Any]], links: CellLinks) -> str:
    if not groups:
        return "<p class='none'>none</p>"
    items = []
    for group in groups:
        tail = group["traceback_tail"] or group["log_tail"]
        items.append(
            f"<div class='fail'><h3>{html.escape(group['outcome'])}: {html.escape(group['reason'])}</h3>"
            f"<p>{len(group['cells'])} cell(s): {links.cells(group['cells'])}</p>"
            + (f"<pre>{html.escape(tail)}</pre>" if tail else "")
            + f"<p class='cite'>log: {html.escape(group['log_path'])}</p></div>"
        )
    return "".join(items)


def _all_cells_rows(frame: Any, curves: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The summary's rows, with what a value needs said beside it: a cell without a median tokens/s (it stopped
    before a timed step) shows the step-0 figure MLflow's tokens_per_s chart has for it, and an estimate outside
    its goal is marked where it happens."""
    low, high = ESTIMATE_GOAL
    rows = frame.to_dict("records")
    for row in rows:
        ratio = row.get("estimate_over_measured")
        if isinstance(ratio, float) and ratio == ratio and ratio > 0 and not low <= ratio <= high:
            row["_estimate_over_measured_html"] = f" <span class='miss'>peak {1 / ratio:.2f}x the estimate</span>"
        if missing(row.get("tokens_per_s")):
            steps = [r.get("tokens_per_s") for r in curves.get(row["cell_id"], []) if r.get("tokens_per_s")]
            if steps:
                row["_tokens_per_s_html"] = (
                    "<span class='untimed' title='the median of the timed steps leaves out step 0; MLflow&#39;s "
                    f"tokens_per_s chart has this figure'>{fmt(float(steps[-1]))} (step {len(steps) - 1}, "
                    "untimed)</span>"
                )
    return rows


STYLE = """
body{font-family:system-ui,sans-serif;margin:1.2em 2em;max-width:1280px;color:#222}
header{border-bottom:1px solid #ddd;margin-bottom:.6em}
h1{margin:.2em 0}
.facts span{margin-right:1.4em;font-size:13px}
nav{font-size:13px;margin:.4em 0 .8em}
table{border-collapse:collapse;font-size:12px;margin:.5em 0 1em}
td,th{border:1px solid #ddd;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f3f3f3}
td.num{text-align:right;white-space:nowrap}
.rec{border-left:4px solid #1e88e5;padding:.1em 1em;margin:.6em 0;background:#f7fbff}
.rec h3{margin:.4em 0}
.rec p{margin:.3em 0}
table.fixes{background:#fff}
table.fixes tr.first td{background:#e8f5e9}
.cells{font-size:11px}
a.cell{white-space:nowrap}
.who,.cite,.notes{font-size:11px;color:#555}
.none{color:#777}
.miss{color:#c62828}
.untimed{color:#777;font-size:11px}
img{max-width:100%}
.scroll{overflow:auto;max-height:32em;max-width:100%;margin:.5em 0 1.5em}
.scroll table{margin:0}
.scroll thead th{position:sticky;top:0;z-index:1}
.sticky td:first-child,.sticky th:first-child{position:sticky;left:0;background:#fff;z-index:2}
.sticky th:first-child{background:#f3f3f3;z-index:3}
.fail{border-left:4px solid #424242;padding:.2em 1em;margin:.8em 0;background:#fafafa}
pre{font-size:11px;background:#f3f3f3;padding:.5em;overflow:auto;max-height:16em}
.counts span{display:inline-block;padding:2px 8px;margin-right:6px;border-radius:3px;color:#fff}
"""


def build_report(
    summary_path: Path,
    result_paths: list[Path],
    capabilities: dict[str, Any],
    environment: dict[str, Any],
    out_dir: Path,
    study: str,
) -> dict[str, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import pandas as pd

    out_dir.mkdir(parents=True, exist_ok=True)
    frame = pd.read_parquet(summary_path)
    results = {}
    curves = {}
    for path in result_paths:
        result = CellResult.from_json(read_json(path)).to_json()  # any version's file, with today's fields
        results[result["cell_id"]] = result
        curves[result["cell_id"]] = read_jsonl(Path(path).parent / "metrics.jsonl")
    recs = recommend(frame, capabilities, curves)

    plots = {
        "outcomes": out_dir / "outcomes.png",
        "loss": out_dir / "loss_curves.png",
        "memory": out_dir / "memory.png",
    }
    plot_outcomes(frame, plots["outcomes"])
    plot_losses(frame, curves, plots["loss"])
    plot_memory(frame, plots["memory"])
    atomic_write_text(out_dir / "recommendations.json", json.dumps([r.as_dict() for r in recs], indent=2))

    counts = frame["outcome"].value_counts().to_dict()
    count_html = "".join(
        f"<span style='background:{OUTCOME_COLOURS.get(k, 'grey')}'>{html.escape(str(k))}: {v}</span>"
        for k, v in sorted(counts.items())
    )
    nan_rows = (
        frame[frame["outcome"] == Outcome.NAN]
        .sort_values([a for a in axis_names() if a in frame.columns])
        .to_dict("records")
    )
    paths = StudyPaths.of_result(result_paths[0]) if result_paths else None
    logs_dir = paths.cell_logs_dir if paths else out_dir
    study_file = paths.study_file if paths else out_dir / "none"
    failures = failure_groups(frame, results, logs_dir)
    links = CellLinks(frame, mlflow_run_base(study_file, paths.tracking if paths else out_dir / "none"))
    quality = dict(zip(frame["cell_id"], frame["quality"], strict=True)) if "quality" in frame.columns else {}
    rec_dicts = [r.as_dict() for r in recs]
    all_columns = [c for c in ALL_CELLS_COLUMNS if _any_value(frame, c)]
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>tunegrid report: {html.escape(study)}</title>
<style>{STYLE}</style></head><body>
{header_html(study, frame, capabilities, environment, count_html)}
{_sources_html(study_file.parent)}
<h2 id="recommendations">Recommendations</h2>{recommendations_html(rec_dicts, quality, links)}
{fixes_html(study_file, rec_dicts, out_dir)}
<h2 id="estimate">Memory estimate misses</h2>{estimate_misses_html(estimate_misses(frame), links)}
<h2 id="matrix">Outcome matrix</h2><img alt="outcome matrix" src="{_png(plots["outcomes"])}">
<h2 id="nan">Non-finite events</h2>{table(nan_rows, NAN_COLUMNS, links)}
<h2 id="failures">Other failures</h2>{_failures_html(failures, links)}
<h2 id="loss">Loss curves</h2><img alt="loss curves" src="{_png(plots["loss"])}">
<h2 id="memory">Peak memory</h2><img alt="peak memory" src="{_png(plots["memory"])}">
<h2 id="memory-settings">Memory settings: what each saves and costs</h2>
{table(memory_setting_rows(frame), MEMORY_SETTING_COLUMNS, links)}
<h2 id="audit">MoE quantization audit</h2>{table(_audit_rows(results), AUDIT_COLUMNS, links)}
<h2 id="cells">All cells</h2>{table(_all_cells_rows(frame, curves), all_columns, links, css="sticky")}
<p class='cite'>Bytes in one unit per column (the exact bytes on hover, as MLflow's metric holds them); a column
header's hover names its MLflow metric (tokens/s is tokens_per_s_median: the median of the timed steps).</p>
{mlflow_note(links.run_base)}
<h2 id="probe">Probe: what the hardware can do</h2>
{table(_probe_facts(capabilities, environment, results), ["fact", "value"])}
</body></html>"""
    atomic_write_text(out_dir / "index.html", page)
    return {"cells": len(frame), "recommendations": len(recs), "outcomes": counts}


def _sources_html(study_dir: Path) -> str:
    """The hub models and datasets the study fetched: pinned, or "not pinned; fetched at <sha>"."""
    from tunegrid.study.sources import fetched_sources

    lines = fetched_sources(study_dir) if study_dir.is_dir() else []
    return "".join(f"<p class='source'>{html.escape(line)}</p>" for line in lines)
