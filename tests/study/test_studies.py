"""The shipped studies (configs/*.yaml): valid, their hub models pinned, and their synthetic
real-width variants build and train a step on CPU at a reduced layer count."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import yaml
from conftest import REPO, run_supervised, work_cell

from tunegrid.dataset import read_dataset
from tunegrid.prepare.checkpoints import produce_checkpoint
from tunegrid.prepare.data import corpus_texts
from tunegrid.runtime.files import read_json
from tunegrid.study.config import cell_spec, expand_cells, load_study

STUDIES = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", STUDIES, ids=lambda p: p.stem)
def test_shipped_study_validates_and_pins_its_hub_models(path):
    # its dry run, as the docs write it (`--config study=configs/<study>.yaml`), is
    # tests/workflow/test_readme_commands.py::test_dry_run_as_written's, once per shipped study
    study = load_study(path)
    for name, model in study["models"].items():
        if model["source"] == "hub":
            assert len(model["revision"]) == 40, f"{name}: hub models are pinned"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("config", "model"), [("gemma3-4b-t4-synthetic", "gemma3-4b-width"), ("moe-qlora-memory-synthetic", "olmoe-width")]
)
def test_real_width_variant_trains_a_step_on_cpu_with_one_layer(config, model, dataset_path, tmp_path):
    study = load_study(REPO / "configs" / f"{config}.yaml")
    study = copy.deepcopy(study)
    study["models"][model]["config"]["num_hidden_layers"] = 1  # the one value reduced for CPU
    study["train"].update(steps=1, seq_len=32, gradient_checkpointing=False)
    texts = list(corpus_texts(read_dataset(dataset_path)))
    produce_checkpoint(study["models"][model], texts, tmp_path / model)
    cell = next(c for c in expand_cells(study) if c.model == model and c.quant == "nf4" and c.batch_size == 1)
    spec = cell_spec(study, cell).to_json()
    spec["axes"] = {**spec["axes"], "precision": "fp32"}
    work_cell(spec, tmp_path / model, dataset_path, tmp_path / "run")
    facts = read_json(tmp_path / "run" / "worker.json")
    assert facts["outcome"] in ("ok", "nan"), facts["reason"]
    assert facts["training"]["steps_run"] == 1
    hidden = yaml.safe_load((REPO / "configs" / f"{config}.yaml").read_text())["models"][model]["config"]["hidden_size"]
    assert read_json(tmp_path / model / "config.json")["hidden_size"] == hidden  # real width kept


GPU_STUDIES = ("gemma3-4b-t4", "gemma3-4b-t4-synthetic", "moe-qlora-memory", "moe-qlora-memory-synthetic")


@pytest.mark.parametrize("name", [*GPU_STUDIES, "collective-timeout"])
def test_gpu_studies_fill_every_row_they_draw(name, checkpoints):
    """Dry: the study's generated set, packed at its seq_len by a tokenizer of the same kind its synthetic
    models train (byte-level BPE on this data), gives every step of the study rows >= 90 % real tokens, and
    one pass over the set holds every row the steps draw (no step trains on a row twice)."""
    from transformers import AutoTokenizer

    from tunegrid.cell.data.packing import build_stream
    from tunegrid.prepare.data import generate_examples

    class PackedModel:  # what packing_mode reads; packed either way (a test module builds no causal mask: EOS)
        config = type("Config", (), {"_attn_implementation": "sdpa"})()

    study = load_study(REPO / "configs" / f"{name}.yaml")
    data, train, grid = study["data"], study["train"], study["grid"]
    assert train["seq_len"] == 2048 and data["packing"]
    tokenizer = AutoTokenizer.from_pretrained(checkpoints["gemma3-hot"])
    records = generate_examples(data["examples"], data["seed"])
    cell_data = cell_spec(study, expand_cells(study)[0]).data  # every cell's: the study's data section
    for batch in grid["batch_size"]:
        stream, facts = build_stream(
            records, tokenizer, PackedModel(), cell_data, train["seq_len"], batch, 0, accum=max(grid["grad_accum"])
        )
        assert facts["packing"] != "off"
        assert facts["rows"] >= train["steps"] * stream.rows_per_step, (batch, facts["rows"])
        for step in range(train["steps"]):
            drawn = stream.row_tokens[stream.indices(step)]
            assert int(drawn.min()) >= 0.9 * train["seq_len"], (batch, step, drawn.tolist())


def test_a_packed_remainder_row_is_dropped_only_when_emptier_than_every_other_row_can_be():
    from tunegrid.cell.data.packing import pack

    def examples(*lengths):
        return [([5] * n, [5] * n) for n in lengths]

    kept = pack(examples(40, 40, 10), 64, 0, 1, "position_ids")  # the last row holds 40 >= 64 - 40
    assert kept.row_tokens.tolist() == [50, 40] and (kept.examples, kept.dropped_examples) == (3, 0)
    dropped = pack(examples(20, 20, 20, 5), 64, 0, 1, "position_ids")  # 5 < 64 - 20: a mostly padded row
    assert dropped.row_tokens.tolist() == [60] and (dropped.examples, dropped.dropped_examples) == (3, 1)
    assert pack(examples(20, 20, 20, 5), 64, 0, 1, "off").row_tokens.tolist() == [20, 20, 20, 5]


@pytest.mark.slow  # a 0.8 GB checkpoint, two loads and a step
def test_moe_oom_at_load_at_reduced_size_ends_oom_at_load_for_nf4_and_ok_for_nf4_experts(dataset_path, tmp_path):
    """configs/moe-oom-at-load.yaml with OLMoE's expert layout (64 experts, 8 active) at half width and a
    quarter of its depth: plain nf4 keeps the fused experts in bf16 and runs out of memory while loading; nf4-experts
    quantizes them as they are read and trains. The budget is the experts' own bf16 bytes: a load that
    holds them whole cannot fit it, one that quantizes them as it reads holds about a quarter of that."""

    study = copy.deepcopy(load_study(REPO / "configs" / "moe-oom-at-load.yaml"))
    ((name, model),) = study["models"].items()
    config = model["config"]
    config.update(
        vocab_size=512,
        hidden_size=config["hidden_size"] // 2,
        intermediate_size=config["intermediate_size"] // 2,
        num_hidden_layers=config["num_hidden_layers"] // 4,
        num_attention_heads=config["num_attention_heads"] // 2,
        num_key_value_heads=config["num_key_value_heads"] // 2,
    )
    experts_bf16 = config["num_hidden_layers"] * config["num_experts"] * 3 * config["intermediate_size"]
    experts_bf16 *= config["hidden_size"] * 2
    study["hardware"]["memory_budget_gb"] = experts_bf16 / 2**30
    study["train"].update(steps=1)
    produce_checkpoint(model, list(corpus_texts(read_dataset(dataset_path))), tmp_path / name)
    capabilities = tmp_path / "capabilities.json"
    probe = [
        sys.executable,
        str(REPO / "scripts" / "tunegrid.py"),
        "probe",
        "--budget-s",
        "3",
        "--out",
        str(capabilities),
    ]
    subprocess.run(probe, check=True, timeout=120)
    results = {}
    for cell in expand_cells(study):
        run_dir = tmp_path / cell.quant
        spec = cell_spec(study, cell).to_json()
        results[cell.quant] = run_supervised(
            spec, {name: tmp_path / name}, dataset_path, run_dir, capabilities=capabilities
        )
    plain, experts = results["nf4"], results["nf4-experts"]
    assert plain["outcome"] == "oom" and plain["diagnosis"]["oom"]["stage"] == "load", plain["reason"]
    assert experts["outcome"] == "ok", experts["reason"]
    assert experts["memory"]["load_peak_bytes"] < plain["diagnosis"]["oom"]["peak_bytes"]
