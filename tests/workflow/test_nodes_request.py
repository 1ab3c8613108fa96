"""`snakemake --profile slurm -n`: a cell across nodes asks SLURM for its nodes, one task on each, and each node's
share of the cores and memory; a cell on one node asks as before."""

from __future__ import annotations

import yaml
from conftest import make_study, slurm_dry_run_finetune_jobs

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
    jobs = slurm_dry_run_finetune_jobs(tmp_path, config)
    keys = ("nodes", "tasks", "cpus_per_task", "mem_mb")
    asked = {cell: {key: job[key] for key in keys} for cell, job in jobs.items()}
    one, two = "qwen3moe-tiny_fp32_bs2_none_s0_ws4", "qwen3moe-tiny_fp32_bs2_none_s0_ws4_nodes2"
    assert asked[one] == {"nodes": 1, "tasks": 1, "cpus_per_task": 8, "mem_mb": 4 * MEM_FLOOR_MB_PER_RANK}
    assert asked[two] == {"nodes": 2, "tasks": 2, "cpus_per_task": 4, "mem_mb": 2 * MEM_FLOOR_MB_PER_RANK}
