#!/usr/bin/env python
"""Accuracy of the memory estimate: estimate / measured peak per cell that ended ok.

Reads the cells of a finished study (default: results/default, from `snakemake --cores 8 all`) and
trains four cells of a larger synthetic model (Gemma 3 text, ~25M params; fp32 and bf16, with and without
NF4, batch 8) in the same run. Goal:
0.9-1.1 for >= 90 % of ok cells, never below 0.85. Writes results/benchmarks/memory_estimate.{json,csv}.

    python benchmarks/memory_estimate.py [--study results/default] [--no-larger] [--worker forked|spawned]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import device_from_argv  # noqa: E402

if __name__ == "__main__":  # --device cpu must hide the GPUs before torch is imported
    DEVICE = device_from_argv()

from machine import add_device_argument, describe, machine_facts  # noqa: E402
from widths import GEMMA3_25M  # noqa: E402

from tunegrid.contract import CellJob  # noqa: E402
from tunegrid.dataset import read_dataset  # noqa: E402
from tunegrid.outcome import CellResult  # noqa: E402
from tunegrid.prepare.cell_plan import write_contract  # noqa: E402
from tunegrid.prepare.checkpoints import produce_checkpoint  # noqa: E402
from tunegrid.prepare.data import corpus_texts, write_dataset  # noqa: E402
from tunegrid.prepare.memory_estimate import device_constants, estimate_cell  # noqa: E402
from tunegrid.run.calibrate import serving_warm_worker  # noqa: E402
from tunegrid.run.calibration_cache import probe_record  # noqa: E402
from tunegrid.run.supervisor import run_cell  # noqa: E402
from tunegrid.runtime.files import read_json, write_json  # noqa: E402
from tunegrid.runtime.workers import FORKED, WARM_SOCKET_ENV, WORKERS  # noqa: E402
from tunegrid.study.config import cell_spec, expand_cells, load_study  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def row(result: dict, source: str) -> dict:
    memory = result["memory"]
    return {
        "source": source,
        "cell_id": result["cell_id"],
        "estimate_mib": memory["estimate_bytes"] / 2**20,
        "measured_mib": memory["peak_bytes"] / 2**20,
        "ratio": memory["estimate_over_measured"],
        "worker": memory.get("estimate_worker") or "spawned",
    }


def larger_cells(work: Path, worker: str) -> list[dict]:
    study = load_study(REPO / "configs" / "config.yaml")
    study["models"]["gemma3-25m"] = {**study["models"]["gemma3-tiny"], "config": GEMMA3_25M}
    study["grid"].update(
        model=["gemma3-25m"], precision=["fp32", "bf16"], batch_size=[8], quant=["none", "nf4"], seed=[0]
    )
    study["train"].update(steps=4, threads=2)
    data = work / "train.jsonl"
    write_dataset(data, 256, 0)
    produce_checkpoint(
        copy.deepcopy(study["models"]["gemma3-25m"]), list(corpus_texts(read_dataset(data))), work / "gemma3-25m"
    )
    capabilities = work / "capabilities.json"
    # as the probe rule records it: with the calibration a study's estimates take (cached per machine and stack)
    write_json(capabilities, probe_record(budget_s=5, world_sizes=[]))
    rows = []
    with contextlib.ExitStack() as stack:
        # forked as a local study's cells are (the warm worker's imports shared), or spawned as a cluster's
        socket = stack.enter_context(serving_warm_worker(work))() if worker == FORKED else None
        os.environ.pop(WARM_SOCKET_ENV, None)
        os.environ.update({WARM_SOCKET_ENV: socket} if socket else {})
        for cell in expand_cells(study):
            run_dir = work / "runs" / cell.cell_id
            job = CellJob(
                model_dir=str(work / "gemma3-25m"),
                data_path=str(data),
                run_dir=str(run_dir),
                result_path=str(run_dir / "result.json"),
                capabilities_path=str(capabilities),
            )
            contract = run_dir.parent / f"{cell.cell_id}.contract.json"
            write_contract(cell_spec(study, cell), job, contract, warm_worker=socket is not None)
            result = run_cell(contract, command=["benchmark"])
            if result["outcome"] == "ok":
                rows.append(row(result, "gemma3-25m"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", default=str(REPO / "results" / "default"))
    parser.add_argument("--no-larger", action="store_true")
    parser.add_argument(
        "--worker",
        choices=WORKERS,
        default=FORKED,
        help="how the larger cells' workers start: forked by a warm worker, as a local study's, or spawned",
    )
    parser.add_argument("--out", default=str(REPO / "results" / "benchmarks"))
    add_device_argument(parser)
    args = parser.parse_args()
    facts = machine_facts(DEVICE)

    rows = []
    study_dir = Path(args.study)
    capabilities = read_json(study_dir / "probe" / "capabilities.json") if (study_dir / "probe").is_dir() else {}
    for path in sorted(study_dir.glob("runs/*/result.json")):
        result = read_json(path)
        if result["outcome"] != "ok" or not result["memory"].get("peak_bytes"):
            continue
        # re-estimated with the current model, so an improved estimator is judged on the same runs (for the
        # worker path each cell took: its runtime constant differs, forked or spawned)
        worker = result["memory"].get("estimate_worker") or "spawned"
        device = result["memory"].get("device") or "cpu"  # the device the cell trained on
        spec = CellResult.from_json(result).cell  # the spec that run recorded, read with today's keys
        constants = device_constants(capabilities, spec.axes.precision, worker, device=device)
        estimate = estimate_cell(spec, study_dir / "models" / spec.model.name, **constants)
        result["memory"]["estimate_bytes"] = estimate.estimate_bytes
        result["memory"]["estimate_over_measured"] = estimate.estimate_bytes / result["memory"]["peak_bytes"]
        rows.append(row(result, study_dir.name))
    if not args.no_larger:
        with tempfile.TemporaryDirectory(prefix="tunegrid-mem-") as tmp:
            rows += larger_cells(Path(tmp), args.worker)
    if not rows:
        sys.exit(f"no ok cells with an estimate under {args.study}; run the study first")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "memory_estimate.json", {"machine": facts, "rows": rows})
    print(describe(facts))
    header = list(rows[0])
    (out / "memory_estimate.csv").write_text(
        "\n".join([",".join(header)] + [",".join(str(r[h]) for h in header) for r in rows]) + "\n"
    )
    print(f"{'source':<12}{'cell':<42}{'estimate MiB':>14}{'measured MiB':>14}{'ratio':>8}  worker")
    for r in rows:
        print(
            f"{r['source']:<12}{r['cell_id']:<42}{r['estimate_mib']:>14.1f}{r['measured_mib']:>14.1f}{r['ratio']:>8.3f}"
            f"  {r['worker']}"
        )
    ratios = [r["ratio"] for r in rows]
    in_band = sum(0.9 <= r <= 1.1 for r in ratios) / len(ratios)
    print(
        f"cells: {len(ratios)}  in 0.9-1.1: {in_band:.0%}  min: {min(ratios):.3f}  max: {max(ratios):.3f}  "
        f"goal (>= 90% in band, none < 0.85): {'met' if in_band >= 0.9 and min(ratios) >= 0.85 else 'missed'}"
    )


if __name__ == "__main__":
    main()
