"""The MLflow tag and param policy of a cell run: what a user filters and groups by in the UI.

One place for it, shared by the supervisor (live) and the sync (runs created from the files afterwards).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tunegrid.cell_spec import CellSpec
from tunegrid.cell_view import CellView
from tunegrid.columns import table_tags
from tunegrid.outcome import CellResult
from tunegrid.study.grid_axes import injected_faults
from tunegrid.vocabulary import FAULTS, with_neutrals

FAULT_AXIS_NEUTRAL = FAULTS[0]  # `debug`: the cell injects what the debug section sets, which may be nothing

# The files of a run folder that its MLflow run keeps as artifacts.


ARTIFACT_FILES = ("result.json", "metrics.jsonl", "events.jsonl", "headroom.jsonl", "audit.json", "adapter")


def run_name(outcome: str, cell_id: str, study_cell_ids: Iterable[str] = ()) -> str:
    """A cell run's name once it ended: the outcome first, so the runs page reads at a glance, then what tells
    the cell apart from the study's other cells (MLflow's name column cuts a long name short, and a study's ids
    share most of their parts). The full id is the run's `tunegrid.cell_id` tag."""
    return f"{outcome} · {distinct_part(cell_id, study_cell_ids)}"


def distinct_part(cell_id: str, study_cell_ids: Iterable[str]) -> str:
    """The cell id less the parts every cell id of the study has (`bs8`, `s0` where all cells share them); the
    whole id where that would leave nothing (the plain twin of `_ac`) or make two cells' names alike."""
    ids = sorted(set(study_cell_ids) | {cell_id})
    if len(ids) < 2:
        return cell_id
    split = [i.split("_") for i in ids]
    common = set.intersection(*map(set, split))
    short = {i: "_".join(p for p in parts if p not in common) or i for i, parts in zip(ids, split)}
    return short[cell_id] if len(set(short.values())) == len(ids) else cell_id


def study_cell_ids(run_dir: Path) -> list[str]:
    """The ids of the cells of the study a run folder belongs to (its study.json), or none when it has none."""
    from tunegrid.track.params import study_specs

    return [spec["cell_id"] for spec in study_specs(run_dir)]  # none: a cell run by hand (its whole id is its name)


def axis_tags(axes: dict[str, Any], debug: dict[str, Any] | None = None) -> dict[str, str]:
    """The cell's axes as tags, and the effective batch they make (micro-batch x accumulation x ranks).

    The fault axis's neutral value (`debug`: whatever the debug section sets) is a tag only where that section
    injects something, named in `fault.injected`; a run without an injection carries no `fault` tag, so none
    reads as if fault injection were on. A value the grid names (none, slow-rank, ...) is always a tag: it is
    what tells the twins apart."""
    tags = {k: str(v) for k, v in axes.items()}
    injected = injected_faults(debug or {})
    if injected:
        tags["fault.injected"] = ",".join(injected)
    elif tags.get("fault") == FAULT_AXIS_NEUTRAL:
        del tags["fault"]
    ran = with_neutrals(axes)  # a result from before the grad_accum or world_size axis ran at its neutral value
    effective = ran["batch_size"] * ran["grad_accum"] * ran["world_size"]
    tags["effective_batch"] = str(effective)
    return tags


def cell_tags(spec: CellSpec) -> dict[str, str]:
    """The tags a cell run starts with: its axes (axis_tags, with what its debug section injects) and its study."""
    return {**axis_tags(spec.axes.axes(), asdict(spec.debug)), "study": spec.study}


def run_tags(record: dict[str, Any] | CellResult) -> dict[str, str]:
    """A cell run's tags, from its result (a CellResult, or result.json as written by any version): the verdict
    (track/diagnosis.py), the column table's tags (tunegrid.columns), and the families named per package or
    source (tunegrid.columns.TAG_FAMILIES_OUTSIDE)."""
    from tunegrid.track.diagnosis import outcome_tags

    result = record if isinstance(record, CellResult) else CellResult.from_json(record)
    tags = outcome_tags(result)
    tags.update(table_tags(CellView(result, {})))  # no table tag reads the axes: they are tags of their own
    for package, version in ((result.env.get("stack") or {}).get("versions") or {}).items():
        if package in ((result.env.get("stack") or {}).get("pins") or {}):
            tags[f"stack.{package}"] = str(version)  # what the cell's library stack pinned, as resolved
    for what in ("model", "data"):  # a hub source's commit; not pinned: fetched at it when the study ran
        source = result.env.get(f"{what}_source") or {}
        if source.get("revision"):
            tags[f"{what}.revision"] = str(source["revision"])
            tags[f"{what}.pinned"] = str(bool(source.get("pinned"))).lower()
    return tags


def env_tags(capabilities: dict[str, Any]) -> dict[str, str]:
    """Versions and device as tags, so the UI can filter and group by them."""
    from tunegrid.runtime.packages import package_version

    tags = {f"env.{name}": package_version(name) or "" for name in ("torch", "transformers", "peft", "bitsandbytes")}
    gpus = capabilities.get("gpus") or []
    tags["env.device"] = gpus[0].get("name", "cuda") if gpus else capabilities.get("device", "cpu")
    return tags


def rerun_tags(result_path: Path, snakemake_job: str) -> dict[str, str]:
    """The Snakemake job that ran the cell and the command that re-runs only this cell."""
    configfiles = os.environ.get("TUNEGRID_CONFIGFILES", "")
    rerun = ["snakemake", "--cores", "1", "--forcerun", str(result_path)]
    for path in filter(None, configfiles.split(os.pathsep)):
        rerun += ["--configfile", path]
    from tunegrid.study.input import STUDY_FILE_ENV

    study_file = os.environ.get(STUDY_FILE_ENV, "")
    if study_file:
        rerun += ["--config", f"study={study_file}"]
    return {"snakemake.job": snakemake_job, "snakemake.rerun": shlex.join(rerun)}


def result_params(result: dict[str, Any]) -> dict[str, str]:
    """The quantization audit's summary as run params (logged once, at the end of the cell)."""
    audit = result.get("quant_audit") or {}
    params: dict[str, str] = {}
    for stage in ("after_load", "after_adapters"):
        summary = audit.get(stage) or {}
        for key in ("total_bytes", "quantized_bytes", "flagged_bytes"):
            if key in summary:
                params[f"audit.{stage}.{key}"] = str(summary[key])
        for role, size in (summary.get("by_role") or {}).items():
            params[f"audit.{stage}.role.{role}_bytes"] = str(size)
        for dtype, size in (summary.get("by_dtype") or {}).items():
            params[f"audit.{stage}.dtype.{dtype}_bytes"] = str(size)
    experts = audit.get("expert_quantization") or {}
    if experts:
        params["audit.expert_quantization.changed"] = str(len(experts.get("changed", [])))
        params["audit.expert_quantization.kept_for_lora"] = str(len(experts.get("kept_for_lora", [])))
        params["audit.expert_quantization.order"] = str(experts.get("order"))
    return params


def dataset_input(result: CellResult, data_path: Path) -> dict[str, Any]:
    """The cell's training set as an MLflow dataset input: what it is, its digest, and its size."""
    import hashlib

    digest = hashlib.sha256()
    with open(data_path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    data, spec = result.data or {}, result.cell.data  # what the worker made of the records, and what the study named
    origin = spec.repo_id or spec.path or "generated"
    return {
        "name": f"{data.get('source') or spec.source}:{Path(str(origin)).name}",
        "digest": digest.hexdigest()[:16],
        "source": {
            "uri": str(Path(data_path).resolve()),
            "origin": str(origin),
            "revision": spec.revision or "",
        },
        "profile": {k: data[k] for k in ("examples", "tokens", "rows", "packing", "fill") if k in data},
    }
