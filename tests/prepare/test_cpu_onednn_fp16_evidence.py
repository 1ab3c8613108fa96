"""The default study on an Intel Xeon whose oneDNN runs fp16 (AVX512-FP16, AMX), replayed against the decision
to train CPU fp16 cells with routed experts without oneDNN there, and against the estimate.

`data/evidence-cpu-xeon-avx512fp16.json` holds that run (`snakemake all` at 6a518b8 on 2026-11-28, 2 cores,
torch 2.13.0+cpu), recorded with `benchmarks/cpu_memory_evidence.py`: every cell's spec, peaks (each step's
too) and estimate, and its probe's constants. At that commit fp16 kept oneDNN, and the six qwen3moe-tiny fp16
cells grew at every step (oneDNN keeps a kernel for every token count an expert sees) to 0.39-0.59 of their
estimate; every other ok cell was in 0.9-1.1. The probe record predates `cpu_onednn_matmul`: the decision is
taken from its fp16 flags, as for any such record. `data/evidence-cpu-default-study.json` holds the runs on
this project's AMD EPYC host (no fp16 units: fp16 never reaches oneDNN), whose decisions must not move.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import meta_model_shapes, recorded_run

from tunegrid.cell_spec import CellSpec
from tunegrid.contract import MemoryEstimate
from tunegrid.prepare.cpu_kernels import cpu_onednn_matmul, cpu_onednn_off
from tunegrid.prepare.environment import cpu_onednn_matmul as asked_torch
from tunegrid.prepare.memory_estimate import device_constants, estimate_from_shapes
from tunegrid.prepare.probes import cpu_inventory, cpu_precision_support

DATA = Path(__file__).resolve().parents[1] / "data"
MIB = 2**20


XEON = recorded_run(json.loads((DATA / "evidence-cpu-xeon-avx512fp16.json").read_text())["runs"][0])
AMD = [recorded_run(run) for run in json.loads((DATA / "evidence-cpu-default-study.json").read_text())["runs"]]


def _ok(run: dict) -> list[dict]:
    return [cell for cell in run["cells"] if cell["outcome"] == "ok"]


def _estimate(run: dict, cell: dict) -> MemoryEstimate:
    """The current estimate of a recorded cell with its run's probe constants, as the planner makes it."""
    spec = cell["spec"]
    config, shapes = meta_model_shapes(run["models"][spec["axes"]["model"]])
    constants = device_constants(run["probe"], spec["axes"]["precision"], cell["estimate_worker"], device="cpu")
    return estimate_from_shapes(CellSpec.from_json(spec), config, shapes, **constants)


def _grew(cell: dict) -> bool:
    return cell["spec"]["axes"]["model"] == "qwen3moe-tiny" and cell["spec"]["axes"]["precision"] == "fp16"


def test_the_recorded_probe_predates_the_field_and_its_flags_say_fp16_goes_to_onednn():
    assert "cpu_onednn_matmul" not in XEON["probe"]
    assert "avx512_fp16" in XEON["probe"]["cpu"]["isa_flags"] and XEON["probe"]["cpu_precision"]["fp16"] == "native"
    assert cpu_onednn_matmul(XEON["probe"]) == {"bf16": True, "fp16": True}
    # where the probe asked torch, its answer stands over the flags
    asked = {**XEON["probe"], "cpu_onednn_matmul": {"bf16": True, "fp16": False}}
    assert cpu_onednn_matmul(asked)["fp16"] is False
    # a record that kept only the ISA flags says the same as its cpu_precision
    flags_only = {key: value for key, value in XEON["probe"].items() if key != "cpu_precision"}
    assert cpu_onednn_matmul(flags_only) == {"bf16": True, "fp16": True}


def test_the_probe_asks_torch_and_a_record_without_its_answer_says_the_same_for_fp16_on_this_host():
    """What the probe records is what torch consults; a record from before it falls back on the fp16 flags, which
    on this host give torch's answer (fp16 goes to oneDNN only with AVX512-FP16 or AMX-FP16)."""
    import torch

    found = asked_torch()
    assert found == {
        "bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "fp16": bool(torch.ops.mkldnn._is_mkldnn_fp16_supported()),
    }
    flags = cpu_inventory()["isa_flags"]
    assert cpu_onednn_matmul({"device": "cpu", "cpu_precision": cpu_precision_support(flags)})["fp16"] == found["fp16"]
    assert cpu_onednn_matmul({"device": "cpu", "cpu_onednn_matmul": found}) == found


def test_the_six_fp16_moe_cells_now_train_without_onednn_and_their_first_step_was_in_band():
    """The decision from the recorded probe turns oneDNN off for those six cells (and the qwen3moe bf16 cells, as
    before) and for no other; their first steps were within 0.9-1.1 of the estimate, and what the decision
    removes is the growth after it, recorded at every step (~8 MiB a step at batch 2, 15-20 at batch 8)."""
    grew = [cell for cell in _ok(XEON) if _grew(cell)]
    assert len(grew) == 6
    for cell in _ok(XEON):
        spec = cell["spec"]
        config = XEON["models"][spec["axes"]["model"]]["config"]
        decision = cpu_onednn_off(CellSpec.from_json(spec), config, "cpu", cpu_onednn_matmul(XEON["probe"]))
        if _grew(cell):
            assert decision and "fp16" in decision and cell["cpu_onednn_off"] is None, spec["cell_id"]
        else:
            assert bool(decision) == bool(cell["cpu_onednn_off"]), spec["cell_id"]  # the bf16 MoE cells, unchanged
    for cell in grew:
        estimate = _estimate(XEON, cell).estimate_bytes
        # the estimate has barely moved since the run (its 4-bit weights: one dequantized copy, not every one)
        assert estimate == pytest.approx(cell["estimate_bytes"], rel=1e-3)
        assert 0.9 <= estimate / cell["first_step_peak_bytes"] <= 1.1, cell["spec"]["cell_id"]
        assert estimate / cell["peak_bytes"] < 0.6, cell["spec"]["cell_id"]
        steps = cell["step_peak_bytes"]
        rises = sum(later > earlier for earlier, later in zip(steps, steps[1:]))
        per_step = (steps[-1] - steps[0]) / (len(steps) - 1)
        assert len(steps) == 30 and rises >= 28 and steps[-1] == cell["peak_bytes"], cell["spec"]["cell_id"]
        assert per_step >= (7 if cell["spec"]["axes"]["batch_size"] == 2 else 14) * MIB, cell["spec"]["cell_id"]


def test_every_other_ok_cell_is_within_ten_percent_of_the_current_estimate():
    others = {cell["spec"]["cell_id"]: cell for cell in _ok(XEON) if not _grew(cell)}
    ratios = {cell_id: _estimate(XEON, cell).estimate_bytes / cell["peak_bytes"] for cell_id, cell in others.items()}
    assert len(ratios) == 24
    assert all(0.9 <= ratio <= 1.1 for ratio in ratios.values()), {k: round(v, 3) for k, v in ratios.items()}
    # and they stayed flat: what oneDNN keeps for their fixed shapes is built by the first step
    for cell_id, cell in others.items():
        assert cell["peak_bytes"] - cell["first_step_peak_bytes"] < 8 * MIB, cell_id


@pytest.mark.parametrize("host", [run["host"] for run in AMD])
def test_the_amd_recordings_keep_their_decisions(host):
    """No fp16 units there: torch keeps fp16 matmuls away from oneDNN, and every recorded cell's decision (the bf16
    MoE cells' off, with the same reason; every fp16 cell's on) is what the current code decides."""
    run = next(run for run in AMD if run["host"] == host)
    assert cpu_onednn_matmul(run["probe"])["fp16"] is False
    fp16_moe = 0
    for cell in run["cells"]:
        spec = cell["spec"]
        config = run["models"][spec["axes"]["model"]]["config"]
        decision = cpu_onednn_off(CellSpec.from_json(spec), config, "cpu", cpu_onednn_matmul(run["probe"]))
        assert decision == cell["cpu_onednn_off"]
        fp16_moe += _grew(cell)
    assert fp16_moe > 0  # the cells the new decision is about are among them, and keep oneDNN
