"""`snakemake --profile slurm -n`: each cell's job asks for the memory its plan derives, not one figure for all."""

from __future__ import annotations

from conftest import REPO, slurm_dry_run_finetune_jobs, stub_contract

from tunegrid.prepare.cell_plan import MEM_FLOOR_MB_PER_RANK, job_mem_mb
from tunegrid.study.config import expand_cells, resolve_study
from tunegrid.study.input_limits import read_study_yaml
from tunegrid.study.paths import StudyPaths

STUDY = REPO / "configs" / "moe-qlora-memory.yaml"


def finetune_mem_mb(workdir) -> dict[str, int]:
    """cell id -> the mem_mb `snakemake --profile slurm -n` shows for its finetune job."""
    return {cell: job["mem_mb"] for cell, job in slurm_dry_run_finetune_jobs(workdir, STUDY).items()}


def test_slurm_dry_run_asks_each_cell_for_its_plans_memory(tmp_path):
    study = resolve_study(read_study_yaml(STUDY))
    cells = list(expand_cells(study))
    # before any plan exists: the stated floor, per rank
    before = finetune_mem_mb(tmp_path)
    assert before == {c.cell_id: MEM_FLOOR_MB_PER_RANK * c.world_size for c in cells}
    # contracts as the cell_plan rule writes them, with estimates of the size these checkpoints have (the 30B MoE's
    # bf16 experts ~58 GB); the hub checkpoints themselves are not downloaded here
    paths = StudyPaths.of(study["study"], tmp_path / "results")
    estimates = {}
    for i, cell in enumerate(cells):
        estimates[cell.cell_id] = (60 if cell.model.startswith("qwen3") else 14) * 2**30 + i * 2**20
        contract = stub_contract(cell.cell_id, cell.world_size, estimates[cell.cell_id])
        paths.cell_plan(cell.cell_id).parent.mkdir(parents=True, exist_ok=True)
        contract.write(paths.cell_plan(cell.cell_id))
    after = finetune_mem_mb(tmp_path)
    assert after == {c.cell_id: job_mem_mb(estimates[c.cell_id], c.world_size) for c in cells}
    assert len(set(after.values())) == len(cells) and 4000 not in after.values()
