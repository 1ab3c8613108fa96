"""The MLflow tag and param policy of a cell run: what a user filters and groups by in the UI.

One place for it, shared by the supervisor (live) and the sync (runs created from the files afterwards).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tunegrid.outcome import CellResult, origin_label
from tunegrid.study.grid_axes import injected_faults
from tunegrid.vocabulary import FAULTS

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


def spec_id(result: dict[str, Any]) -> str:
    return str(result["cell"]["cell_id"])


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
    effective = axes["batch_size"] * axes.get("grad_accum", 1) * axes.get("world_size", 1)
    tags["effective_batch"] = str(effective)
    return tags


def run_tags(record: dict[str, Any] | CellResult) -> dict[str, str]:
    """A cell run's tags, from its result (a CellResult, or result.json as written by any version)."""
    from tunegrid.track.diagnosis import outcome_tags

    result = record if isinstance(record, CellResult) else CellResult.from_json(record)
    diagnosis = result.diagnosis
    tags = outcome_tags(result.to_json())
    tags.update(outcome=str(result.outcome), device=result.env.get("device", ""))
    tags["outcome.reason"] = result.reason
    for package, version in ((result.env.get("stack") or {}).get("versions") or {}).items():
        if package in ((result.env.get("stack") or {}).get("pins") or {}):
            tags[f"stack.{package}"] = str(version)  # what the cell's library stack pinned, as resolved
    for what in ("model", "data"):  # a hub source's commit; not pinned: fetched at it when the study ran
        source = result.env.get(f"{what}_source") or {}
        if source.get("revision"):
            tags[f"{what}.revision"] = str(source["revision"])
            tags[f"{what}.pinned"] = str(bool(source.get("pinned"))).lower()
    if result.resumed_from_step is not None:
        tags["resumed_from_step"] = str(result.resumed_from_step)
    slurm_job = (result.env.get("scheduler") or {}).get("SLURM_JOB_ID")
    if slurm_job:
        tags["slurm.job_id"] = slurm_job
    nan = diagnosis.nan
    if nan:
        tags.update(
            {
                "nan.kind": nan.kind,
                "nan.step": str(nan.step),
                "nan.forward_module": origin_label(nan.forward_origin) or "",
                "nan.backward_module": origin_label(nan.backward_origin) or "",
            }
        )
    audit = result.quant_audit
    if audit.get("after_adapters"):
        final = audit["after_adapters"]
        tags.update(
            {
                "audit.weight_bytes": str(final["total_bytes"]),
                "audit.flagged_bytes": str(final["flagged_bytes"]),
                "audit.flagged_share": f"{final['flagged_share']:.4f}",
                "audit.flagged_tensors": str(len(final["flagged"])),
                "lora.unmatched": ",".join(audit["lora"]["unmatched"]),
            }
        )
    collective = diagnosis.collective
    if collective:
        tags.update(
            {
                "collective.op": str(collective.op),
                "collective.missing_ranks": ",".join(map(str, collective.missing_ranks)),
                "collective.timeout_s": str(collective.timeout_s),
                "collective.step": str(collective.step),
            }
        )
        if collective.kind:
            tags["collective.diagnosis"] = collective.kind
    straggler = (collective.straggler if collective else None) or result.distributed.get("straggler")
    if straggler:  # the straggler a timeout is blamed on, or an early warning in a cell that did not time out
        tags.update({"straggler.rank": str(straggler["rank"]), "straggler.ratio": f"{straggler['median_ratio']:g}"})
    link = result.distributed.get("slow_link")
    if link:  # the collectives slow while every rank kept pace (tunegrid.run.link_check)
        tags.update(
            {"slow_link.ratio": f"{link['ratio']:g}", "slow_link.collective_s": f"{link['collective_s_median']:g}"}
        )
    islands = result.fp32_islands
    if islands:  # fp16-islands: which modules computed in fp32, and what the calibration measured there
        tags["fp32_islands"] = ",".join(m["module"] for m in islands["modules"]) or "none"
        tags["fp32_islands.mode"] = islands["mode"]
        tags["fp32_islands.max_abs"] = ",".join(
            f"{m['max_abs']:.0f}" if m.get("max_abs") is not None else "" for m in islands["modules"]
        )
    crash = diagnosis.rank_crash
    if crash:
        tags.update({"rank_crash.ranks": ",".join(map(str, crash.ranks)), "rank_crash.exit": crash.exit})
    if result.optimizer.get("state_bytes") is not None:
        optimizer = result.optimizer
        tags.update({"optimizer.state_bytes": str(optimizer["state_bytes"]), "optimizer.paging": optimizer["paging"]})
    oom = diagnosis.oom
    if oom:
        tags["oom.stage"] = str(oom.stage)
    memory = result.memory
    if memory.get("estimate_bytes"):
        tags["memory.estimate_bytes"] = str(memory["estimate_bytes"])
        tags["memory.estimate_over_measured"] = (
            f"{memory['estimate_over_measured']:.3f}" if memory.get("estimate_over_measured") else ""
        )
        tags["memory.estimate_worker"] = str(memory.get("estimate_worker") or "")
    if memory.get("cpu_onednn_off"):  # why this cell trained without oneDNN (prepare/cpu_kernels.py)
        tags["kernels.cpu_onednn_off"] = str(memory["cpu_onednn_off"])
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


def dataset_input(result: dict[str, Any], data_path: Path) -> dict[str, Any]:
    """The cell's training set as an MLflow dataset input: what it is, its digest, and its size."""
    import hashlib

    digest = hashlib.sha256()
    with open(data_path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    data = result.get("data") or {}
    spec = result["cell"].get("data") or {}
    origin = spec.get("repo_id") or spec.get("path") or "generated"
    return {
        "name": f"{data.get('source') or spec.get('source', 'synthetic')}:{Path(str(origin)).name}",
        "digest": digest.hexdigest()[:16],
        "source": {
            "uri": str(Path(data_path).resolve()),
            "origin": str(origin),
            "revision": spec.get("revision") or "",
        },
        "profile": {k: data[k] for k in ("examples", "tokens", "rows", "packing", "fill") if k in data},
    }
