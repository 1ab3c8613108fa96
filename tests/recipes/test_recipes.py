"""Bring your recipe: held-out axolotl and TRL / Transformers recipes (tests/data/recipes/, written from each
tool's documentation) import to studies whose baseline cell is the recipe and that Snakemake dry-runs; every
key is carried, listed as not carried, or an error naming it; the key tables agree with the real TRL and
Transformers dataclasses; and export gives the recipe back unchanged, or changed only where a fix changes it."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import REPO, snakemake_command, workflow_env

from tunegrid.cli.main import main
from tunegrid.meanings import PRECISION_ROWS
from tunegrid.recipes.core import RecipeError
from tunegrid.recipes.export import export_cell, exported_mapping, split_trl
from tunegrid.recipes.importer import baseline_cell_id, expand_base, import_recipe
from tunegrid.recipes.trl import DEFAULTS, MODEL_CONFIG_KEYS, SCRIPT_ARGUMENTS_KEYS, SFT_ONLY_KEYS
from tunegrid.study.config import expand_cells, resolve_study

RECIPES = REPO / "tests" / "data" / "recipes"
CHAT = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch) -> Path:
    """The held-out recipes beside the local models and data files they name (fake checkpoints: config.json)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    shutil.copytree(RECIPES, tmp_path, dirs_exist_ok=True)
    for name, config in {
        "local-gemma": {"model_type": "gemma3_text"},
        "local-qwen3-moe": {"model_type": "qwen3_moe", "num_experts": 8},
    }.items():
        (tmp_path / "models" / name).mkdir(parents=True)
        (tmp_path / "models" / name / "config.json").write_text(json.dumps(config))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "chat.jsonl").write_text("\n".join(json.dumps(CHAT) for _ in range(4)) + "\n")
    table = {"question": ["2+2?"] * 4, "answer": ["4"] * 4, "prompt": ["2+2?"] * 4, "completion": ["4"] * 4}
    pq.write_table(pa.table(table), tmp_path / "data" / "pairs.parquet")
    monkeypatch.chdir(tmp_path)
    return tmp_path


IMPORTS = {  # recipe -> (import options, the baseline cell, settings the study must hold)
    "axolotl-qlora-hub.yaml": (
        {"failure": "nan"},
        "gemma-3-1b-it_bf16_bs2_nf4_s42_ga4",
        {"train.seq_len": 2048, "train.lr": 0.0002, "train.lr_scheduler": "cosine_with_min_lr", "lora.r": 32,
         "data.source": "hub", "data.layout": "alpaca", "data.packing": True,
         "train.gradient_checkpointing": True, "train.warmup_steps": 5, "train.steps": 50},
    ),
    "axolotl-fsdp-8bit-optim.yaml": (
        {"failure": "oom", "ignore": ["optimizer", "peft_use_dora"]},
        "local-qwen3-moe_fp16_bs4_none_s42",
        {"lora.target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], "data.loss_on": "all",
         "train.weight_offloading": True,
         "data.layout": {"field_instruction": "question", "field_output": "answer"}, "data.source": "parquet",
         "distributed.collective_timeout_s": 600.0, "train.lr_scheduler": "linear"},
    ),
    "trl-sft-qlora.json": (
        {"failure": "all"},
        "local-gemma_bf16_bs4_nf4_s42_ga2",
        {"train.gradient_checkpointing": True, "train.lr_scheduler": "cosine_with_min_lr", "train.min_lr_rate": 0.1,
         "data.layout": "prompt_completion", "data.loss_on": "response",
         "lora.r": 16, "train.warmup_steps": 2},
    ),
    "trl-sft-chat.yaml": (
        {"failure": "timeout"},
        "local-gemma_fp16_bs8_none_s3",
        {"data.fields": {"messages": "messages"}, "data.loss_on": "response", "lora.alpha": 32.0,
         "train.steps": 40, "train.gradient_checkpointing": False, "train.lr": 2e-5},
    ),
    "transformers-training-args.json": (
        {"failure": "nan", "ignore": ["optim"], "model": "models/local-gemma", "dataset": "data/chat.jsonl",
         "seq_len": 96},
        "local-gemma_bf16_bs16_none_s42",
        {"train.seq_len": 96, "train.lr_scheduler": "constant_with_warmup", "train.warmup_steps": 10,
         "distributed.collective_timeout_s": 7200.0, "train.gradient_checkpointing": False},
    ),
}  # fmt: skip


def _settings(study: dict, path: str):
    section, key = path.split(".", 1)
    return study[section][key]


@pytest.mark.parametrize("name", sorted(IMPORTS))
def test_a_held_out_recipe_imports_to_a_study_whose_baseline_is_the_recipe(workdir, name):
    options, baseline, expected = IMPORTS[name]
    study, recipe, header = import_recipe({"recipe": name, **options})
    resolved = resolve_study(study)
    assert baseline_cell_id(resolved) == baseline and baseline in {c.cell_id for c in expand_cells(resolved)}
    for path, value in expected.items():
        assert _settings(resolved, path) == value, path
    # every key of the recipe is carried, listed (not carried, run differently, unknown), or ignored at the
    # user's word: none is lost
    used = {k.split(".")[0] for keys in recipe.origin.values() for k in keys} | recipe.accounted
    listed = {*recipe.not_carried, *recipe.differs, *recipe.unknown}
    accounted = used | {k.split(".")[0].split(":")[0] for k in listed} | {k.split(".")[0] for k in recipe.ignored}
    assert set(recipe.raw) <= accounted, set(recipe.raw) - accounted
    text = "\n".join(header)
    assert all(f"  {key}: " in text for key in (*listed, *recipe.ignored))


def test_the_grid_varies_what_bears_on_the_failure(workdir):
    nan, _, _ = import_recipe({"recipe": "axolotl-qlora-hub.yaml", "failure": "nan"})
    rows = sorted(PRECISION_ROWS.values(), key=lambda row: row.nan_fix_rank)  # every row, the fp16 fixes too
    assert nan["grid"]["precision"] == ["bf16", *(str(r.precision) for r in rows if r.precision != "bf16")]
    assert nan["grid"]["quant"] == ["nf4"]
    assert list(zip(nan["grid"]["batch_size"], nan["grid"]["grad_accum"])) == [(2, 4), (1, 8)]  # same effective
    assert {c.batch_size * c.grad_accum for c in expand_cells(resolve_study(nan))} == {8}, "never crossed"
    oom, _, _ = import_recipe({"recipe": "axolotl-fsdp-8bit-optim.yaml", "failure": "oom",
                               "ignore": ["optimizer", "peft_use_dora", "fsdp_config"]})  # fmt: skip
    assert oom["grid"]["quant"] == ["none", "nf4-experts", "nf4", "int8"], "the memory fixes; nf4-experts for MoE"
    assert oom["grid"]["precision"] == ["fp16"]
    timeout, _, _ = import_recipe({"recipe": "trl-sft-chat.yaml", "failure": "timeout"})
    assert timeout["grid"]["world_size"] == [1, 2] and timeout["grid"]["precision"] == ["fp16"]


@pytest.mark.parametrize(
    ("name", "options", "keys", "needed"),
    [
        ("axolotl-fsdp-8bit-optim.yaml", {}, ["optimizer"], []),
        ("transformers-training-args.json", {"model": "models/local-gemma", "dataset": "data/chat.jsonl"},
         ["optim"], ["max_length"]),
    ],
)  # fmt: skip
def test_keys_tunegrid_cannot_honour_are_errors_naming_each_key(workdir, name, options, keys, needed, capsys):
    with pytest.raises(RecipeError) as caught:
        import_recipe({"recipe": name, **options})
    lines = str(caught.value).splitlines()
    for key in keys:  # droppable at the user's word
        assert any(f"recipe key {key!r}" in line and f"--ignore {key}" in line for line in lines), (key, lines)
    for key in needed:  # a study cannot do without it: no --ignore offered, and none accepted
        assert any(f"recipe key {key!r}" in line and "--ignore" not in line for line in lines), (key, lines)
        with pytest.raises(RecipeError, match=f"recipe key {key!r}"):
            import_recipe({"recipe": name, **options, "ignore": [*keys, *needed]})
    # the command says the same, without a traceback
    assert main(["import", name, *sum((["--" + k.replace("_", "-"), v] for k, v in options.items()), [])]) == 2
    assert f"recipe key {(keys or needed)[0]!r}" in capsys.readouterr().err


def test_an_unpinned_hub_model_and_a_second_dataset_import_and_say_so(workdir):
    study, recipe, header = import_recipe({"recipe": "axolotl-two-datasets-unpinned.yaml"})
    assert study["models"]["Llama-3.2-1B"]["revision"] == "" and "datasets.1" in recipe.differs
    study, recipe, header = import_recipe({"recipe": "trl-hub-dataset.yaml"})
    assert (study["data"]["repo_id"], study["data"]["revision"]) == ("trl-lib/Capybara", "")
    assert any("not pinned" in line for line in header)


def test_import_writes_a_study_whose_header_lists_what_was_not_carried(workdir, capsys):
    assert main(["import", "axolotl-qlora-hub.yaml", "--failure", "nan", "--out", "study.yaml"]) == 0
    out = capsys.readouterr().out
    text = Path("study.yaml").read_text()
    for key in ("wandb_project", "flash_attention", "val_set_size", "output_dir", "num_epochs", "tf32"):
        assert f"  {key}" in out and f"#   {key}" in text, key
    assert "Baseline cell (the recipe itself): gemma-3-1b-it_bf16_bs2_nf4_s42_ga4" in out
    study = yaml.safe_load(text)
    assert study["base"] == {"recipe": "axolotl-qlora-hub.yaml", "from": "axolotl", "failure": "nan", "ignore": []}
    assert resolve_study(expand_base(study)) == resolve_study(study), "re-reading the base changes nothing"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(IMPORTS))
def test_the_imported_studies_dry_run_in_snakemake(workdir, name):
    options, _, _ = IMPORTS[name]
    args = ["import", name, "--failure", options["failure"], "--out", f"{name}.study.yaml"]
    args += ["--ignore", *options["ignore"]] if options.get("ignore") else []
    for key in ("model", "dataset", "seq_len"):
        args += [f"--{key.replace('_', '-')}", str(options[key])] if key in options else []
    assert main(args) == 0
    done = subprocess.run(
        snakemake_command(workdir, "all", "-n", "--cores", "2", "--configfile", f"{name}.study.yaml"),
        capture_output=True, text=True, env=workflow_env(), cwd=workdir, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "finetune" in done.stdout


@pytest.mark.slow
def test_a_study_with_only_a_base_key_runs_the_recipe_directly(workdir):
    Path("from-recipe.yaml").write_text(
        yaml.safe_dump({"study": "from-recipe", "base": {"recipe": "trl-sft-chat.yaml", "failure": "nan"}})
    )
    done = subprocess.run(
        snakemake_command(workdir, "all", "-n", "--cores", "2", "--configfile", "from-recipe.yaml"),
        capture_output=True, text=True, env=workflow_env(), cwd=workdir, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "local-gemma_fp16_bs8_none_s3" in done.stdout and "local-gemma_fp32_bs2_none_s3_ga4" in done.stdout


def test_trl_key_tables_and_defaults_agree_with_the_installed_dataclasses(tmp_path):
    from transformers import TrainingArguments
    from trl import ModelConfig, ScriptArguments, SFTConfig

    fields = {cls: {f.name for f in dataclasses.fields(cls)} for cls in (ModelConfig, ScriptArguments, SFTConfig)}
    assert MODEL_CONFIG_KEYS - {"trust_remote_code"} == fields[ModelConfig]
    assert SCRIPT_ARGUMENTS_KEYS - {"datasets"} == fields[ScriptArguments]
    assert SFT_ONLY_KEYS <= fields[SFTConfig] - {f.name for f in dataclasses.fields(TrainingArguments)}
    sft, model = SFTConfig(output_dir=str(tmp_path), use_cpu=True), ModelConfig()
    plain = TrainingArguments(output_dir=str(tmp_path), use_cpu=True)
    for key, value in DEFAULTS["trl"].items():
        real = getattr(sft, key) if hasattr(sft, key) else getattr(model, key)
        assert getattr(real, "value", real) == value, key
    for key, value in DEFAULTS["transformers"].items():
        assert getattr(getattr(plain, key), "value", getattr(plain, key)) == value, key
    assert sft.bf16 and not plain.bf16, "SFTConfig trains bf16 unless told otherwise; TrainingArguments fp32"


def _resolved(name: str, **options) -> dict:
    study, recipe, _ = import_recipe({"recipe": name, **options})
    resolved = resolve_study(study)
    resolved["base"]["from"] = recipe.tool
    return resolved


@pytest.mark.parametrize("name", ["axolotl-qlora-hub.yaml", "trl-sft-qlora.json", "trl-sft-chat.yaml"])
def test_export_of_the_baseline_cell_gives_the_recipe_back_unchanged(workdir, name):
    study = _resolved(name, failure="all")
    to = "axolotl" if name.startswith("axolotl") else "trl"
    done = export_cell(study, baseline_cell_id(study), to)
    assert done.changes == {} and done.keys == {} and done.diff == []
    text = Path(name).read_text()
    assert done.text == text and exported_mapping(done) == (
        json.loads(text) if name.endswith(".json") else yaml.safe_load(text)
    )


def test_an_exported_fix_changes_only_what_the_fix_changes(workdir):
    study = _resolved("axolotl-qlora-hub.yaml", failure="all")
    done = export_cell(study, "gemma-3-1b-it_fp32_bs1_nf4_s42_ga8", "axolotl")
    assert done.changes == {"precision": "fp32", "batch_size": 1, "grad_accum": 8}
    assert done.keys == {"bf16": False, "micro_batch_size": 1, "gradient_accumulation_steps": 8}
    before, after = yaml.safe_load(Path("axolotl-qlora-hub.yaml").read_text()), exported_mapping(done)
    assert {k for k in after if after.get(k) != before.get(k)} == set(done.keys)
    assert sum(line.startswith("+") and not line.startswith("+++") for line in done.diff) == 3
    assert "# Held-out" in done.text, "the user's comments stay"


def test_exported_trl_arguments_construct_trl_dataclasses(workdir, tmp_path):
    from trl import ModelConfig, ScriptArguments, SFTConfig, TrlParser

    study = _resolved("trl-sft-chat.yaml", failure="all")  # fp16 recipe; the fix: fp32 at the same batch
    done = export_cell(study, "local-gemma_fp32_bs8_none_s3", "trl")
    assert done.keys == {"fp16": False, "bf16": False}, "SFTConfig would train bf16 without bf16: false"
    args = exported_mapping(done)
    parts = split_trl(args)
    config = SFTConfig(**parts["SFTConfig"], use_cpu=True)
    assert not config.fp16 and not config.bf16 and config.max_length == 128 and config.seed == 3
    assert ModelConfig(**parts["ModelConfig"]).use_peft and ScriptArguments(**parts["ScriptArguments"])
    # TRL's own parser (what `trl sft --config` runs) takes the flat file as exported
    script, sft, model = TrlParser((ScriptArguments, SFTConfig, ModelConfig)).parse_dict({**args, "use_cpu": True})
    assert sft.per_device_train_batch_size == 8 and model.lora_target_modules == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
    ]
    baseline = exported_mapping(export_cell(study, baseline_cell_id(study), "trl"))
    assert SFTConfig(**split_trl(baseline)["SFTConfig"], use_cpu=True).fp16, "the recipe itself, as it was"


def test_export_refuses_what_the_tool_cannot_say(workdir):
    from tunegrid.study.errors import ConfigError

    study = _resolved("trl-sft-qlora.json", failure="oom")
    with pytest.raises(ConfigError, match="export it --to trl"):
        export_cell(study, baseline_cell_id(study), "axolotl")
    with pytest.raises(ConfigError, match="not a cell"):
        export_cell(study, "nope_fp32_bs1_none_s0", "trl")


def test_quantization_is_read_and_written_through_the_quant_rows(workdir):
    Path("eight.yaml").write_text(
        "model_name_or_path: models/local-gemma\nuse_peft: true\nload_in_8bit: true\ndataset_name: data/chat.jsonl\n"
    )
    study = _resolved("eight.yaml", failure="oom")
    assert study["grid"]["quant"] == ["int8", "nf4"], "8-bit loading is the int8 row; the others as memory fixes"
    assert export_cell(study, baseline_cell_id(study).replace("int8", "nf4"), "trl").keys == {
        "load_in_4bit": True,
        "load_in_8bit": False,
    }, "nf4 is the file's own bnb_4bit_quant_type default, so only the loading flags change"
    Path("four.yaml").write_text("model_name_or_path: models/local-gemma\nuse_peft: true\nload_in_4bit: true\n"
                                 "bnb_4bit_quant_type: fp4\ndataset_name: data/chat.jsonl\n")  # fmt: skip
    with pytest.raises(RecipeError, match="recipe key 'bnb_4bit_quant_type'"):
        import_recipe({"recipe": "four.yaml"})


EIGHT_BIT = {  # (tool, the tool's optimizer name) -> the optimizer axis value of the baseline cell
    ("axolotl", "adamw_bnb_8bit"): "adamw-8bit",
    ("axolotl", "paged_adamw_8bit"): "paged-adamw-8bit",
    ("trl", "adamw_8bit"): "adamw-8bit",
    ("trl", "paged_adamw_8bit"): "paged-adamw-8bit",
}


def _recipe_with(tool: str, optimizer: str, checkpointing: bool | None = None) -> str:
    name = f"{tool}-{optimizer}.yaml"
    if tool == "axolotl":
        text = ("base_model: models/local-gemma\nadapter: lora\nmicro_batch_size: 4\n"
                "datasets:\n  - path: data/chat.jsonl\n    type: chat_template\n"
                f"optimizer: {optimizer}  # the user's choice\n")  # fmt: skip
    else:
        text = "model_name_or_path: models/local-gemma\nuse_peft: true\ndataset_name: data/chat.jsonl\n"
        text += f"optim: {optimizer}\n"
    if checkpointing is not None:
        text += f"gradient_checkpointing: {str(checkpointing).lower()}\n"
    Path(name).write_text(text)
    return name


@pytest.mark.parametrize(("tool", "name"), sorted(EIGHT_BIT))
def test_the_tools_8bit_adamw_names_import_as_the_optimizer_axis_and_export_back(workdir, tool, name, tmp_path):
    from transformers import Trainer, TrainingArguments

    from tunegrid.cell.memory.optimizers import BNB_CLASSES

    axis = EIGHT_BIT[(tool, name)]
    recipe = _recipe_with(tool, name)
    study = _resolved(recipe, failure="oom")
    assert study["grid"]["optimizer"] == [axis], "an 8-bit recipe is not offered AdamW's fp32 moments as a fix"
    assert baseline_cell_id(study).endswith(f"_{axis}")
    done = export_cell(study, baseline_cell_id(study), "axolotl" if tool == "axolotl" else "trl")
    assert done.keys == {} and done.text == Path(recipe).read_text(), "the recipe comes back byte for byte"
    # the independent reference: the optimizer transformers itself builds for the name takes the same step, to
    # the bit, as the one tunegrid's axis value trains with (8-bit moments of a tensor over 4096 elements)
    import torch

    from tunegrid.cell.memory.optimizers import make_optimizer

    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(TrainingArguments(str(tmp_path), optim=name, use_cpu=True))
    theirs_p, ours_p = (torch.nn.Parameter(torch.linspace(-1, 1, 8192)) for _ in range(2))
    theirs = cls([theirs_p], **{**kwargs, "lr": 1e-2, "weight_decay": 0.1})
    ours = make_optimizer([ours_p], axis, lr=1e-2, weight_decay=0.1)
    for step in range(3):
        for param, opt in ((theirs_p, theirs), (ours_p, ours)):
            param.grad = torch.sin(torch.arange(8192.0) * (step + 1))
            opt.step()
    assert type(ours).__name__ == BNB_CLASSES[axis] and kwargs["is_paged"] == ("paged" in axis)
    assert torch.equal(theirs_p, ours_p) and ours.state[ours_p]["state1"].dtype == torch.uint8


@pytest.mark.parametrize("tool", ["axolotl", "trl"])
def test_other_optimizers_stay_refused_naming_the_key(workdir, tool):
    key = "optimizer" if tool == "axolotl" else "optim"
    for name in ("lion_8bit", "adafactor"):  # paged_adamw_32bit: AdamW's update, carried as the nearest axis value
        with pytest.raises(RecipeError, match=rf"recipe key {key!r}: optimizer {name!r} is not one tunegrid trains"):
            import_recipe({"recipe": _recipe_with(tool, name)})


def test_the_oom_grid_varies_the_optimizer_and_activation_checkpointing_around_the_recipe(workdir):
    plain = _resolved(_recipe_with("axolotl", "adamw_torch"), failure="oom")
    assert plain["grid"]["optimizer"] == ["adamw", "adamw-8bit"]
    assert plain["grid"]["activation_checkpointing"] == [False, True], "the recipe keeps activations"
    assert baseline_cell_id(plain) == "local-gemma_fp32_bs4_none_s42", "the baseline is the recipe, as before"
    ids = {c.cell_id for c in expand_cells(plain)}
    assert {"local-gemma_fp32_bs4_none_s42_adamw-8bit", "local-gemma_fp32_bs4_none_s42_ac"} <= ids
    checkpointed = _resolved(_recipe_with("trl", "adamw_torch", checkpointing=True), failure="oom")
    assert checkpointed["grid"]["activation_checkpointing"] == [False], "already checkpointing: nothing to vary"
    nan = _resolved(_recipe_with("axolotl", "adamw_torch"), failure="nan")
    assert nan["grid"]["optimizer"] == ["adamw"] and nan["grid"]["activation_checkpointing"] == [False]
    header = import_recipe({"recipe": "axolotl-adamw_torch.yaml", "failure": "oom"})[2]
    assert any("adamw-8bit" in line and "activation checkpointing" in line for line in header)


def test_the_oom_grid_tries_the_chunked_loss_where_the_recipe_takes_the_full_one(workdir):
    plain = _resolved(_recipe_with("axolotl", "adamw_torch"), failure="oom")
    assert plain["grid"]["loss"] == ["full", "chunked"]
    assert "local-gemma_fp32_bs4_none_s42_loss-chunked" in {c.cell_id for c in expand_cells(plain)}
    assert baseline_cell_id(plain) == "local-gemma_fp32_bs4_none_s42"
    header = import_recipe({"recipe": "axolotl-adamw_torch.yaml", "failure": "oom"})[2]
    assert any("chunked loss" in line for line in header)
    assert _resolved(_recipe_with("axolotl", "adamw_torch"), failure="nan")["grid"]["loss"] == ["full"]
    fused = Path("fused.yaml")
    fused.write_text(Path("axolotl-adamw_torch.yaml").read_text() + "plugins:\n  - x.CutCrossEntropyPlugin\n")
    assert _resolved("fused.yaml", failure="oom")["grid"]["loss"] == ["full"], "chunked already: nothing to vary"
    # a model whose logits are scaled after the head (Cohere's logit_scale): the chunks would not reproduce it
    config = Path("models/local-gemma/config.json")
    config.write_text(json.dumps({"model_type": "cohere", "logit_scale": 0.0625}))
    assert _resolved(_recipe_with("axolotl", "adamw_torch"), failure="oom")["grid"]["loss"] == ["full"]


@pytest.mark.parametrize("tool", ["axolotl", "trl"])
def test_an_exported_chunked_loss_fix_says_which_key_of_the_tool_carries_it(workdir, tool):
    study = _resolved(_recipe_with(tool, "adamw_torch"), failure="oom")
    done = export_cell(study, baseline_cell_id(study) + "_loss-chunked", tool)
    assert done.changes == {"loss": "chunked"} and done.keys == {} and done.diff == []
    (note,) = done.notes
    assert ("CutCrossEntropyPlugin" if tool == "axolotl" else "use_liger_kernel: true") in note


def test_an_exported_memory_fix_writes_the_tools_own_optimizer_and_checkpointing_keys(workdir, tmp_path):
    from trl import ModelConfig, ScriptArguments, SFTConfig, TrlParser

    study = _resolved(_recipe_with("axolotl", "adamw_torch"), failure="oom")
    done = export_cell(study, "local-gemma_fp32_bs4_none_s42_adamw-8bit_ac", "axolotl")
    assert done.changes == {"optimizer": "adamw-8bit", "activation_checkpointing": True}
    assert done.keys == {"optimizer": "adamw_bnb_8bit", "gradient_checkpointing": True}
    assert "optimizer: adamw_bnb_8bit  # the user's choice" in done.text, "rewritten in place, comment kept"
    Path("fixed.yaml").write_text(done.text)
    fixed = _resolved("fixed.yaml", failure="nan")  # the fix, imported again, is the fix's cell
    assert baseline_cell_id(fixed) == "local-gemma_fp32_bs4_none_s42_adamw-8bit"
    assert fixed["train"]["gradient_checkpointing"] is True
    # TRL: optim and the checkpointing key under the name the file uses, as the real parser reads them
    study = _resolved(_recipe_with("trl", "adamw_torch_fused", checkpointing=False), failure="oom")
    study["grid"]["optimizer"].append("paged-adamw-8bit")  # as a study file's own grid may list it
    done = export_cell(study, baseline_cell_id(study) + "_paged-adamw-8bit_ac", "trl")
    assert done.keys == {"optim": "paged_adamw_8bit", "gradient_checkpointing": True}
    _, sft, _ = TrlParser((ScriptArguments, SFTConfig, ModelConfig)).parse_dict(
        {**exported_mapping(done), "output_dir": str(tmp_path), "use_cpu": True}
    )
    assert sft.optim == "paged_adamw_8bit" and sft.activation_checkpointing is True
    Path("plain.yaml").write_text("model_name_or_path: models/local-gemma\ndataset_name: data/chat.jsonl\n")
    study = _resolved("plain.yaml", failure="oom", **{"from": "transformers", "seq_len": 64})
    done = export_cell(study, baseline_cell_id(study) + "_ac", "trl")
    assert done.keys == {"activation_checkpointing": True}, "a file naming neither: transformers 5's name"


def test_a_stack_fix_exports_as_the_versions_to_install_not_a_key(workdir):
    study = _resolved("axolotl-qlora-hub.yaml", failure="all")
    study["stacks"], study["grid"]["stack"] = {"tf-v4": {"transformers": "4.57.*"}}, ["base", "tf-v4"]
    done = export_cell(study, baseline_cell_id(study) + "_stack-tf-v4", "axolotl")
    assert done.changes == {"stack": "tf-v4"} and done.keys == {} and done.diff == []
    assert done.notes == [
        "stack tf-v4: not a key of a axolotl config; install its versions: pip install 'transformers==4.57.*'"
    ]
