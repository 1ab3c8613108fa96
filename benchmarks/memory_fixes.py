#!/usr/bin/env python
"""Memory fixes against the plain setting, measured in one run: the peak and tokens/s of bitsandbytes' 8-bit
AdamW, activation checkpointing and both, each divided by the plain cell's (torch AdamW, activations kept).

Runs configs/memory-fixes-cpu.yaml through Snakemake (one cell at a time, so the cells do not share cores),
or reads a finished run of it (--study-dir), and prints one row per setting with the ratios last.

    python benchmarks/memory_fixes.py                      # CPU: ~6 minutes on 2 cores
    python benchmarks/memory_fixes.py --study-dir results/memory-fixes-cpu

Writes results/benchmarks/memory_fixes.json with the machine facts (machine.py).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from machine import describe, machine_facts, write_results  # noqa: E402

STUDY = "memory-fixes-cpu"


def run_study(workdir: Path) -> Path:
    config = REPO / "configs" / f"{STUDY}.yaml"
    command = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir)]
    subprocess.run([*command, "all", "--cores", "2", "--configfile", str(config)], check=True)
    return workdir / "results" / STUDY


def ratios(study_dir: Path) -> list[dict[str, object]]:
    frame = pd.read_csv(study_dir / "summary.csv", keep_default_na=False).set_index("cell_id")
    plain = frame[(frame["optimizer"] == "adamw") & (~frame["activation_checkpointing"].astype(bool))].iloc[0]
    rows = []
    for cell_id, cell in frame.iterrows():
        setting = " + ".join(
            [cell["optimizer"]] * (cell["optimizer"] != "adamw")
            + ["activation checkpointing"] * bool(cell["activation_checkpointing"])
        )
        rows.append(
            {
                "cell": cell_id,
                "setting": setting or "plain",
                "outcome": cell["outcome"],
                "optimizer_state_bytes": int(cell["optimizer_state_bytes"]),
                "optimizer_state_estimate_bytes": int(cell["optimizer_state_estimate_bytes"]),
                "estimate_over_measured": round(float(cell["estimate_over_measured"]), 3),
                "peak_ratio": round(float(cell["peak_bytes"]) / float(plain["peak_bytes"]), 3),
                "tokens_per_s_ratio": round(float(cell["tokens_per_s"]) / float(plain["tokens_per_s"]), 3),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study-dir", type=Path, help="a finished run of configs/memory-fixes-cpu.yaml")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        study_dir = args.study_dir or run_study(Path(tmp))
        rows = ratios(study_dir)
    facts = machine_facts("cpu")
    print(describe(facts))
    print(pd.DataFrame(rows).to_string(index=False))
    print(f"wrote {write_results('memory_fixes', facts, rows)}")


if __name__ == "__main__":
    main()
