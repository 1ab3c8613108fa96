"""The study's comparison report: one self-contained HTML page plus the PNGs it embeds. Built from the files
(summary.parquet, each cell's result.json and metrics.jsonl, the probe record), never from MLflow, so it can be
rebuilt with the store down. Opens from disk: images are inlined."""

from __future__ import annotations

import base64
import html
import json
import numbers
from pathlib import Path
from typing import Any

from tunegrid.outcome import CellResult
from tunegrid.recipes.recipe_export import fixes_html
from tunegrid.review.advice import Recommendation
from tunegrid.review.memory_advice import memory_setting_rows
from tunegrid.review.plots import OUTCOME_COLOURS, plot_losses, plot_memory, plot_outcomes
from tunegrid.review.recommend import recommend
from tunegrid.review.run_links import mlflow_note, mlflow_run_base, run_link
from tunegrid.review.stack_advice import stack_facts
from tunegrid.runtime.files import atomic_write_text, read_json, read_jsonl
from tunegrid.study.paths import StudyPaths
from tunegrid.units import human_bytes
from tunegrid.vocabulary import Outcome, axis_names


def _png(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


# Column labels a person reads; values are written for people too (bytes in MiB/GiB, no 4.027e+08).
LABELS = {
    "cell_id": "cell",
    "nan_step": "first non-finite step",
    "nan_kind": "kind",
    "nan_forward_module": "forward origin",
    "nan_backward_module": "backward origin",
    "fp16_headroom_worst_module": "worst fp16 headroom: module",
    "fp16_headroom_worst_where": "worst fp16 headroom: where (a layer's output is the residual stream after it)",
    "fp16_headroom_worst_ratio": "worst |activation| at real tokens / 65504 (sampled steps + the failing step)",
    "steps_run": "steps",
    "effective_batch": "effective batch (micro-batch x accumulation x ranks)",
    "resumed_from_step": "resumed from step",
    "final_loss": "final loss",
    "skipped_steps": "skipped",
    "quality_note": "quality judged on",
    "peak_bytes": "peak memory",
    "estimate_over_measured": "estimate / peak",
    "tokens_per_s": "tokens/s",
    "mlflow_run_id": "MLflow run",
}
COUNT_COLUMNS = ("steps_run", "skipped_steps", "nan_step", "effective_batch", "resumed_from_step")
NAN_COLUMNS = [
    "cell_id",
    "nan_step",
    "nan_kind",
    "nan_forward_module",
    "nan_backward_module",
    "fp16_headroom_worst_module",
    "fp16_headroom_worst_ratio",
]
AUDIT_COLUMNS = ["cell", "outcome", "weight bytes", "by dtype", "expert bytes", "flagged share", "flagged tensors"]
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
# the quality columns (loss_fall, quality, loss_deviation) and fp32_islands: review/quality.py, cell/islands.py
ALL_CELLS_COLUMNS = """cell_id outcome reason effective_batch steps_run resumed_from_step final_loss loss_fall quality
quality_note loss_deviation fp32_islands skipped_steps peak_bytes estimate_over_measured tokens_per_s
optimizer_state_bytes collective_diagnosis straggler_rank collective_parted mlflow_run_id""".split()


def _any_value(frame: Any, column: str) -> bool:
    """A column to show: present and set for some cell (a grid without ranks has no collective columns)."""
    return column in frame.columns and bool(frame[column].notna().any())


def _label(column: str) -> str:
    return LABELS.get(column, column.replace("_", " "))


def _cell(row: dict[str, Any], column: str, run_base: str | None) -> str:
    text = html.escape(_fmt(row.get(column), column))
    return run_link(text, run_base) if column == "mlflow_run_id" else text


def _table(rows: list[dict[str, Any]], columns: list[str], run_base: str | None = None) -> str:
    if not rows:
        return "<p class='none'>none</p>"
    head = "".join(f"<th>{html.escape(_label(c))}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{_cell(r, c, run_base)}</td>" for c in columns) + "</tr>" for r in rows)
    return f"<div class='scroll'><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"


def _fmt(value: Any, column: str = "") -> str:
    if value is None or (isinstance(value, float) and value != value):
        return ""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return str(value)
    if "bytes" in column:
        return human_bytes(value)
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return str(value)
    if column in COUNT_COLUMNS or isinstance(value, numbers.Integral):
        return f"{int(value):,}"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}" if abs(value) < 1 else f"{value:.4g}"


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
    rows = []
    for cell_id, result in sorted(results.items()):
        final = (result.get("quant_audit") or {}).get("after_adapters") or {}
        if not (final.get("by_role") or {}).get("experts"):
            continue
        flagged = final.get("flagged") or []
        rows.append(
            {
                "cell": cell_id,
                "outcome": result["outcome"],
                "weight bytes": final.get("total_bytes"),
                "by dtype": ", ".join(
                    f"{k}: {human_bytes(v)}" for k, v in sorted((final.get("by_dtype") or {}).items())
                ),
                "expert bytes": final["by_role"]["experts"],
                "flagged share": final.get("flagged_share"),
                "flagged tensors": ", ".join(f.get("name", "") if isinstance(f, dict) else str(f) for f in flagged[:4])
                + (f" (+{len(flagged) - 4})" if len(flagged) > 4 else ""),
            }
        )
    return rows


def _recommendation_html(recs: list[Recommendation]) -> str:
    if not recs:
        return "<p class='none'>No failure in this grid has a fix that the grid itself shows working.</p>"
    items = []
    for rec in recs:
        fixes = "".join(
            f"<li><b>{html.escape(', '.join(f'{k}={v}' for k, v in fix.change.items()))}</b>: {html.escape(fix.why)}"
            f" <span class='cite'>(shown by {html.escape(', '.join(fix.evidence))})</span></li>"
            for fix in rec.fixes
        )
        cites = []
        if rec.failing:
            cites.append(f"failing: {html.escape(', '.join(rec.failing))}")
        elif rec.concerns:
            cites.append(f"concerns: {html.escape(', '.join(rec.concerns))}")
        if rec.evidence:
            cites.append(f"evidence: {html.escape(', '.join(rec.evidence))}")
        items.append(
            f"<div class='rec'><h3>{html.escape(rec.title)}</h3><p>{html.escape(rec.text)}</p>"
            + (f"<p>Each of these is a fix on its own:</p><ul>{fixes}</ul>" if fixes else "")
            + f"<p class='cite'>{'<br>'.join(cites)}</p></div>"
        )
    return "".join(items)


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


def _failures_html(groups: list[dict[str, Any]]) -> str:
    if not groups:
        return "<p class='none'>none</p>"
    items = []
    for group in groups:
        tail = group["traceback_tail"] or group["log_tail"]
        items.append(
            f"<div class='fail'><h3>{html.escape(group['outcome'])}: {html.escape(group['reason'])}</h3>"
            f"<p>{len(group['cells'])} cell(s): {html.escape(', '.join(group['cells']))}</p>"
            + (f"<pre>{html.escape(tail)}</pre>" if tail else "")
            + f"<p class='cite'>log: {html.escape(group['log_path'])}</p></div>"
        )
    return "".join(items)


STYLE = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
table{border-collapse:collapse;font-size:12px;margin:.5em 0 1.5em}
td,th{border:1px solid #ddd;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f3f3f3}
.rec{border-left:4px solid #1e88e5;padding:.2em 1em;margin:.8em 0;background:#f7fbff}
.cite{font-size:11px;color:#555}
.none{color:#777}
img{max-width:100%}
.scroll{overflow:auto;max-height:32em;max-width:100%;margin:.5em 0 1.5em}
.scroll table{margin:0}
.scroll thead th{position:sticky;top:0}
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
    logs_dir = StudyPaths.of_result(result_paths[0]).cell_logs_dir if result_paths else out_dir
    study_file = StudyPaths.of_result(result_paths[0]).study_file if result_paths else out_dir / "none"
    failures = failure_groups(frame, results, logs_dir)
    tracking_file = StudyPaths.of_result(result_paths[0]).tracking if result_paths else out_dir / "none"
    run_base = mlflow_run_base(study_file, tracking_file)
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>tunegrid report: {html.escape(study)}</title>
<style>{STYLE}</style></head><body>
<h1>tunegrid report: {html.escape(study)}</h1>
<p class="counts">{len(frame)} cells: {count_html}</p>
{_sources_html(study_file.parent)}
<h2>Probe: what the hardware can do</h2>{_table(_probe_facts(capabilities, environment, results), ["fact", "value"])}
<h2>Recommendations</h2>{_recommendation_html(recs)}
{fixes_html(study_file, [r.as_dict() for r in recs], out_dir)}
<h2>Outcome matrix</h2><img alt="outcome matrix" src="{_png(plots["outcomes"])}">
<h2>Non-finite events</h2>{_table(nan_rows, NAN_COLUMNS)}
<h2>Other failures</h2>{_failures_html(failures)}
<h2>Loss curves</h2><img alt="loss curves" src="{_png(plots["loss"])}">
<h2>Peak memory</h2><img alt="peak memory" src="{_png(plots["memory"])}">
<h2>Memory settings: what each saves and costs</h2>{_table(memory_setting_rows(frame), MEMORY_SETTING_COLUMNS)}
<h2>MoE quantization audit</h2>{_table(_audit_rows(results), AUDIT_COLUMNS)}
<h2>All cells</h2>{_table(frame.to_dict("records"), [c for c in ALL_CELLS_COLUMNS if _any_value(frame, c)], run_base)}
{mlflow_note(run_base)}
</body></html>"""
    atomic_write_text(out_dir / "index.html", page)
    return {"cells": len(frame), "recommendations": len(recs), "outcomes": counts}


def _sources_html(study_dir: Path) -> str:
    """The hub models and datasets the study fetched: pinned, or "not pinned; fetched at <sha>"."""
    from tunegrid.study.sources import fetched_sources

    lines = fetched_sources(study_dir) if study_dir.is_dir() else []
    return "".join(f"<p class='source'>{html.escape(line)}</p>" for line in lines)
