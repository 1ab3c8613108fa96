"""lora.loftq_bits: peft's LoftQ initialization, as axolotl's `peft.loftq_config` asks for it. peft computes it on
CUDA only (its loftq_init moves each weight there), so a CPU cell is `unsupported` before launch and the worker
refuses to start it; on a GPU the cell hands peft exactly LoftQ's arguments. LoftQ needs an unquantized base."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, make_study, one_cell, one_cell_spec

from tunegrid.cell.load.model import loftq_arguments
from tunegrid.cell_spec import CellSpec
from tunegrid.runtime.files import read_json
from tunegrid.study.config import resolve_study
from tunegrid.study.errors import ConfigError
from tunegrid.targets import needs_cuda

H100 = read_json(REPO / "tests" / "data" / "capabilities-h100.json")  # recorded on a one-GPU machine
LOFTQ = {"loftq_bits": 4, "loftq_iter": 1}


def _on(device: str) -> SimpleNamespace:
    return SimpleNamespace(parameters=lambda: iter([SimpleNamespace(device=torch.device(device))]))


def test_peft_gets_loftqs_arguments_on_a_gpu_and_a_cpu_cell_never_starts():
    from peft import LoraConfig

    loftq = one_cell_spec(lora={"target_modules": ["q_proj"], **LOFTQ}).lora
    arguments = loftq_arguments(loftq, _on("cuda"))
    config = LoraConfig(r=8, target_modules=["q_proj"], **arguments)
    assert config.init_lora_weights == "loftq" and config.loftq_config == {"loftq_bits": 4, "loftq_iter": 1}
    assert loftq_arguments(one_cell_spec().lora, _on("cpu")) == {}  # loftq_bits 0
    with pytest.raises(RuntimeError, match="LoftQ initialization runs on CUDA only"):
        loftq_arguments(loftq, _on("cpu"))


def test_the_plan_says_unsupported_where_the_cell_would_train_on_the_cpu():
    from tunegrid.runtime.devices import training_device

    def planned(spec: CellSpec, capabilities: dict) -> tuple[str, str] | None:  # as the plan asks, for its device
        return needs_cuda(spec, training_device(spec.hardware.gpus_per_rank, capabilities))

    spec = one_cell_spec(lora={"target_modules": ["q_proj"], **LOFTQ})
    verdict = planned(spec, {"device": "cpu", "gpus": []})
    assert verdict is not None and verdict[0] == "unsupported" and "CUDA only" in verdict[1]
    assert planned(spec, H100) is None
    assert planned(replace(spec, hardware=replace(spec.hardware, gpus_per_rank=0)), H100) is not None
    assert planned(one_cell_spec(), {"device": "cpu"}) is None


def test_a_study_with_loftq_over_a_quantized_base_is_refused():
    study = make_study(lora={"target_modules": ["q_proj"], **LOFTQ})
    study["grid"]["quant"] = ["none", "nf4"]
    with pytest.raises(ConfigError, match=r"lora.loftq_bits.*\['nf4'\]"):
        resolve_study(study)
    study["grid"]["quant"] = ["none"]
    assert resolve_study(study)["lora"]["loftq_bits"] == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_loftq_cell_trains_over_the_round_trip_of_its_base(checkpoints, dataset_path, tmp_path):
    from conftest import run_in_process

    spec = one_cell(lora={"target_modules": ["q_proj", "v_proj"], **LOFTQ}, train={"steps": 2})
    facts = run_in_process(spec, checkpoints, dataset_path, tmp_path)
    assert facts["outcome"] == "ok", facts["reason"]
    assert read_json(tmp_path / "adapter" / "base_model.json")["load"]["loftq"] == {"bits": 4, "iter": 1}
