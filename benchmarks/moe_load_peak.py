#!/usr/bin/env python
"""Load peak against steady peak for nf4-experts, and nf4-experts against plain nf4, at OLMoE's width.

OLMoE-1B-7B's published config (allenai/OLMoE-1B-7B-0924: width 2048, 64 experts of width 1024, 8
active) with synthetic bf16 weights, written tensor by tensor. Each quantization trains a few LoRA steps
in a fresh process (tunegrid's own worker), so each peak is that cell's alone; no memory budget. Prints,
side by side from the one run:

- nf4-experts load peak / its steady (training) peak: near 1 when the load never holds more than the
  quantized model plus one tensor; plain nf4's (its bf16 experts at load) for comparison;
- peak of nf4-experts / peak of nf4, whole process and above the process's own runtime (the CPU
  meter is RSS, which includes the interpreter and libraries; CUDA's allocator peak does not).

    python benchmarks/moe_load_peak.py                  # CPU: 4 of the 16 layers, seq 64, 2 steps
    python benchmarks/moe_load_peak.py --quick          # CPU: 1 layer at OLMoE's width, 1 step
    python benchmarks/moe_load_peak.py --device cuda    # all 16 layers, seq 2048, LoRA on attention and experts

Writes results/benchmarks/moe_load_peak.json with the machine facts.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import device_from_argv  # noqa: E402

if __name__ == "__main__":  # --device cpu must hide the GPUs before torch is imported
    DEVICE = device_from_argv()

from machine import add_device_argument, describe, machine_facts, write_results  # noqa: E402

from tunegrid.cell_spec import CellSpec  # noqa: E402
from tunegrid.contract import CellJob  # noqa: E402
from tunegrid.dataset import read_dataset  # noqa: E402
from tunegrid.prepare.cell_plan import write_contract  # noqa: E402
from tunegrid.prepare.checkpoints import produce_checkpoint  # noqa: E402
from tunegrid.prepare.data import corpus_texts, write_dataset  # noqa: E402
from tunegrid.runtime.files import read_json  # noqa: E402
from tunegrid.study.config import cell_spec, expand_cells, load_study  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STUDY = REPO / "configs" / "moe-oom-at-load.yaml"
WORKER = (
    "import sys; from tunegrid.cell.train import run_worker; from tunegrid.contract import CellContract; "
    "run_worker(CellContract.read(sys.argv[1]))"
)
MiB = 2**20


def run_cell(spec: CellSpec, model_dir: Path, data: Path, run_dir: Path) -> dict:
    """One cell in a fresh process (its peak is its own); the worker's facts."""
    run_dir.mkdir(parents=True, exist_ok=True)
    job = CellJob(model_dir=str(model_dir), data_path=str(data), run_dir=str(run_dir), result_path="")
    write_contract(spec, job, run_dir / "contract.json", warm_worker=False)  # the cell's plan, as the rule makes it
    env_path = str(REPO / "src")
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; sys.path.insert(0, {env_path!r}); {WORKER}",
            str(run_dir / "contract.json"),
        ],
        check=True,
    )
    return read_json(run_dir / "worker.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: 16 on cuda, 4 on cpu)")
    parser.add_argument("--out", default=str(REPO / "results" / "benchmarks"))
    add_device_argument(parser)
    args = parser.parse_args()
    facts = machine_facts(DEVICE)
    on_gpu = DEVICE == "cuda"
    study = copy.deepcopy(load_study(STUDY))
    ((name, model),) = study["models"].items()
    layers = args.layers or (16 if on_gpu else 1 if args.quick else 4)
    model["config"]["num_hidden_layers"] = layers
    study["hardware"]["memory_budget_gb"] = 0  # measured, not limited
    study["train"].update(steps=1 if args.quick else 2, seq_len=2048 if on_gpu else 64, time_limit_s=3600)
    if on_gpu:
        study["lora"]["target_parameters"] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    work = Path(tempfile.mkdtemp(prefix="tunegrid-moe-load-"))
    data = work / "train.jsonl"
    write_dataset(data, 64, 0)
    produce_checkpoint(model, list(corpus_texts(read_dataset(data))), work / name)
    rows = []
    for cell in expand_cells(study):
        spec = cell_spec(study, cell)
        worker = run_cell(spec, work / name, data, work / "runs" / cell.quant)
        memory = worker["memory"]
        rows.append(
            {
                "quant": cell.quant,
                "layers": layers,
                "outcome": worker["outcome"],
                "runtime_bytes": memory.get("runtime_bytes_measured") or 0,
                "load_peak_bytes": memory.get("load_peak_bytes"),
                "steady_peak_bytes": memory.get("steady_peak_bytes"),
                "peak_bytes": memory.get("peak_bytes"),
            }
        )
    by = {row["quant"]: row for row in rows}
    experts, plain = by["nf4-experts"], by["nf4"]
    runtime = experts["runtime_bytes"]
    ratios = {
        "nf4-experts load/steady": experts["load_peak_bytes"] / experts["steady_peak_bytes"],
        "nf4 load/steady": plain["load_peak_bytes"] / plain["steady_peak_bytes"],
        "peak nf4-experts/nf4": experts["peak_bytes"] / plain["peak_bytes"],
        "peak nf4-experts/nf4 above runtime": (experts["peak_bytes"] - runtime) / (plain["peak_bytes"] - runtime),
    }
    path = write_results("moe_load_peak", facts, {"rows": rows, "ratios": ratios}, args.out)
    print(describe(facts))
    print(f"OLMoE-1B-7B width, {layers} of 16 layers, bf16, batch 1, seq {study['train']['seq_len']}")
    for row in rows:
        peaks = ", ".join(
            f"{k.removesuffix('_bytes')} {row[k] / MiB:.0f} MiB"
            for k in ("load_peak_bytes", "steady_peak_bytes", "peak_bytes")
        )
        print(f"  {row['quant']:<12} {row['outcome']:<4} {peaks}")
    for label, value in ratios.items():
        print(f"{label}: {value:.3f}")
    print(json.dumps({"written": str(path)}))


if __name__ == "__main__":
    main()
