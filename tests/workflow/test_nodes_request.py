"""`snakemake --profile slurm -n`: a cell across nodes asks SLURM for its nodes, one task on each, and each node's
share of the cores and memory; a cell on one node asks as before."""

from __future__ import annotations

import re
import subprocess

import yaml
from conftest import REPO, make_study, snakemake_command, workflow_env

from tunegrid.prepare.cell_plan import MEM_FLOOR_MB_PER_RANK


def test_a_cell_across_nodes_asks_for_its_nodes_and_each_nodes_share(tmp_path):
    grid = {"model": ["qwen3moe-tiny"], "precision": ["fp32"], "batch_size": [2], "quant": ["none"], "seed": [0]}
    study = make_study(
        study="nodes",
        grid={**grid, "world_size": [4], "nodes": [1, 2]},
        train={"steps": 3, "seq_len": 32, "threads": 2},
        hardware={"gpus_per_rank": 0},
    )
    config = tmp_path / "study.yaml"
    config.write_text(yaml.safe_dump(study))
    proc = subprocess.run(
        snakemake_command(tmp_path, "--profile", "slurm", "-n", "--configfile", str(config)),
        cwd=REPO,  # Snakemake finds the `slurm` profile in the folder it is started from
        env=workflow_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    asked = {}
    for job in re.findall(r"rule finetune:\n(.*?)\n\n", proc.stdout + proc.stderr, flags=re.S):
        cell = re.search(r"runs/([^/]+)/result\.json", job).group(1)
        asked[cell] = {
            key: int(re.search(rf"\b{key}=(\d+)", job).group(1))
            for key in ("nodes", "tasks", "cpus_per_task", "mem_mb")
        }
    one, two = "qwen3moe-tiny_fp32_bs2_none_s0_ws4", "qwen3moe-tiny_fp32_bs2_none_s0_ws4_nodes2"
    assert asked[one] == {"nodes": 1, "tasks": 1, "cpus_per_task": 8, "mem_mb": 4 * MEM_FLOOR_MB_PER_RANK}
    assert asked[two] == {"nodes": 2, "tasks": 2, "cpus_per_task": 4, "mem_mb": 2 * MEM_FLOOR_MB_PER_RANK}
