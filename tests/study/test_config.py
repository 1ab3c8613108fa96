from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml
from conftest import REPO, make_study, one_cell_spec, snakemake_command

from tunegrid.study.config import ConfigError, cell_spec, expand_cells, load_study, resolve_study, spec_json
from tunegrid.vocabulary import PRECISIONS


def test_defaults_are_filled_from_the_schema():
    study = resolve_study(make_study())
    assert study["lora"]["r"] == 8
    assert study["train"]["on_nonfinite"] == "stop_after_skips"
    assert study["tracking"]["enabled"] is True
    assert study["models"]["gemma3-hot"]["revision"] == ""


def test_cells_are_the_product_of_the_axes_in_stable_order():
    grid = {
        "model": ["gemma3-hot", "qwen3moe-tiny"],
        "precision": ["fp32", "fp16"],
        "batch_size": [2, 4],
        "quant": ["nf4"],
        "seed": [0],
    }
    cells = expand_cells(resolve_study(make_study(grid=grid)))
    assert len(cells) == 8
    assert cells[0].cell_id == "gemma3-hot_fp32_bs2_nf4_s0"
    assert cells[-1].cell_id == "qwen3moe-tiny_fp16_bs4_nf4_s0"
    assert len({c.cell_id for c in cells}) == 8


def test_cell_spec_is_canonical_json():
    study = resolve_study(make_study())
    cell = expand_cells(study)[0]
    again = resolve_study(make_study())
    a, b = spec_json(cell_spec(study, cell).to_json()), spec_json(cell_spec(again, cell).to_json())
    assert a == b
    assert '"precision":"fp32"' in a


def test_grid_exclude_drops_the_cells_that_have_every_value_an_entry_names():
    grid = {
        "model": ["gemma3-hot", "qwen3moe-tiny"],
        "precision": ["fp32", "fp16", "fp16-islands"],
        "batch_size": [2, 4],
        "quant": ["none"],
        "exclude": [{"model": "qwen3moe-tiny", "precision": "fp16-islands"}, {"precision": "fp16", "batch_size": 4}],
    }
    study = resolve_study(make_study(grid=grid))
    ids = [c.cell_id for c in expand_cells(study)]
    full = [c.cell_id for c in expand_cells(resolve_study(make_study(grid={**grid, "exclude": []})))]
    dropped = {"qwen3moe-tiny_fp16-islands_bs2_none_s0", "qwen3moe-tiny_fp16-islands_bs4_none_s0"}
    dropped |= {"gemma3-hot_fp16_bs4_none_s0", "qwen3moe-tiny_fp16_bs4_none_s0"}
    assert len(full) == 12 and ids == [c for c in full if c not in dropped]  # the rest, in the product's order
    assert "gemma3-hot_fp16-islands_bs4_none_s0" in ids and "gemma3-hot_fp16_bs2_none_s0" in ids
    assert resolve_study(make_study())["grid"]["exclude"] == []  # the schema's default: nothing left out


@pytest.mark.parametrize(
    ("exclude", "expected"),
    [
        ([{"precison": "fp16"}], "config key 'grid.exclude.0': unknown key(s) ['precison']; allowed keys: ["),
        ([{"precision": "fp8"}], "config key 'grid.exclude.0.precision': 'fp8' is not allowed; choose one of"),
        ([{"batch_size": "two"}], "config key 'grid.exclude.0.batch_size'"),
        ([{}], "config key 'grid.exclude.0'"),
        (
            [{"model": "gemma3-hot"}, {"precision": "bf16"}],
            "config key 'grid.exclude.1.precision': 'bf16' is not a value of grid.precision ['fp32']",
        ),
        ([{"model": "gemma3-hot"}], "config key 'grid.exclude': leaves no cell of the grid"),
    ],
)
def test_a_bad_grid_exclusion_names_the_field(exclude, expected):
    raw = make_study()
    raw["grid"]["exclude"] = exclude
    with pytest.raises(ConfigError) as info:
        resolve_study(raw)
    assert expected in str(info.value)


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda s: s.update(unknown_key=1), "unknown key(s) ['unknown_key']"),
        (lambda s: s["grid"].update(precision=["fp8"]), "grid.precision.0"),
        (lambda s: s["grid"].update(batch_size=[0]), "grid.batch_size.0"),
        (lambda s: s["grid"].update(batch_size=["two"]), "grid.batch_size.0"),
        (lambda s: s["grid"].update(model=[]), "grid.model"),
        (lambda s: s["grid"].update(model=["nope"]), "'nope' is not defined under 'models'"),
        (lambda s: s["train"].update(steps=0), "train.steps"),
        (
            lambda s: s["models"].update({"hub-model": {"source": "hub", "repo_id": "google/gemma-3-4b-it", "ref": 7}}),
            "models.hub-model.ref",
        ),
        (lambda s: s["models"].update({"loc": {"source": "local", "path": "/does/not/exist"}}), "models.loc.path"),
        (lambda s: s.update(study="../escape"), "config key 'study'"),
        (lambda s: s["grid"].update(grad_accum=[0]), "grid.grad_accum.0"),
        (
            lambda s: s.update(debug={"inject_nonfinite": {"module": "model.norm", "step": 1, "micro_batch": 2}}),
            "config key 'debug.inject_nonfinite.micro_batch': 2 does not exist; grid.grad_accum is at most 1",
        ),
    ],
)
def test_invalid_configs_name_the_key(mutate, expected):
    raw = make_study()
    mutate(raw)
    with pytest.raises(ConfigError) as info:
        resolve_study(raw)
    assert expected in str(info.value)


def test_enum_error_lists_allowed_values():
    raw = make_study()
    raw["grid"]["quant"] = ["int3"]
    with pytest.raises(ConfigError, match=r"choose one of \['none', 'nf4', 'nf4-experts', 'int8', 'int8-experts'\]"):
        resolve_study(raw)


def test_missing_config_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_study(tmp_path / "nope.yaml")


def test_shipped_default_config_is_valid():
    study = load_study(REPO / "configs" / "config.yaml")
    grid = study["grid"]
    full = len(grid["model"]) * len(grid["precision"]) * len(grid["batch_size"]) * len(grid["quant"])
    cells = expand_cells(study)
    # left out as repeats: qwen3moe-tiny's fp16-islands (its fp16 does not overflow) and gemma3-tiny's
    # nf4-experts (no experts: loaded exactly as nf4)
    assert not any(c.model == "qwen3moe-tiny" and c.precision == "fp16-islands" for c in cells)
    assert not any(c.model == "gemma3-tiny" and c.quant == "nf4-experts" for c in cells)
    per_model = {m: {(c.precision, c.batch_size, c.quant) for c in cells if c.model == m} for m in grid["model"]}
    assert len(per_model["gemma3-tiny"]) == 4 * 2 * 2 and len(per_model["qwen3moe-tiny"]) == 3 * 2 * 3
    assert len(cells) == 34 < full
    assert {"gemma3-tiny", "qwen3moe-tiny"} <= set(study["models"])


def test_snakemake_rejects_bad_config_before_any_job(tmp_path):
    raw = make_study()
    raw["grid"]["precision"] = ["fp8"]
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump(raw))
    proc = subprocess.run(
        snakemake_command(tmp_path, "-n", "--cores", "1", "--configfile", str(config)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "config key 'grid.precision.0'" in out
    assert f"choose one of {list(PRECISIONS)}" in out
    assert "Traceback" not in out


def test_snakefile_parse_does_not_import_torch():
    code = (
        "import sys; sys.path.insert(0, 'src'); import tunegrid.study.config, tunegrid.track.tracking, "
        "tunegrid.review.summary;"
        "assert 'torch' not in sys.modules, 'torch imported at parse time'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


def _dry_run(tmp_path, *args):
    done = subprocess.run(
        snakemake_command(tmp_path, "-n", "--cores", "1", "all", *args),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    counts = dict(
        line.split()[:2] for line in done.stdout.splitlines() if line.startswith(("finetune ", "model_checkpoint "))
    )
    return {k: int(v) for k, v in counts.items()}


def test_a_study_file_is_the_whole_study_and_the_default_applies_only_without_one(tmp_path):
    import yaml

    study = tmp_path / "one.yaml"
    study.write_text(
        yaml.safe_dump(
            {
                "study": "one",
                "models": {"m1": {"source": "synthetic", "architecture": "qwen3_moe", "config": {"hidden_size": 64}}},
                "grid": {"model": ["m1"]},
            }
        )
    )
    assert _dry_run(tmp_path, "--configfile", str(study)) == {"finetune": 1, "model_checkpoint": 1}
    default = load_study(REPO / "configs" / "config.yaml")
    assert _dry_run(tmp_path)["finetune"] == len(expand_cells(default))  # no study file: configs/config.yaml


def test_command_line_overrides_are_typed_by_the_schema(tmp_path):
    from tunegrid.study.input import coerce_overrides

    raw = {
        "execution": {"warm_worker": "False"},
        "train": {"gradient_checkpointing": "true", "steps": "5", "lr": "1e-3"},
        "grid": {"batch_size": ["2", "4"], "precision": "[fp32, bf16]"},
    }
    typed = coerce_overrides(raw)
    assert typed == {
        "execution": {"warm_worker": False},
        "train": {"gradient_checkpointing": True, "steps": 5, "lr": 0.001},
        "grid": {"batch_size": [2, 4], "precision": ["fp32", "bf16"]},
    }
    assert resolve_study(make_study(**{"train": {**make_study()["train"], **typed["train"]}}))["train"]["steps"] == 5
    counts = _dry_run(
        tmp_path,
        "--config",
        "execution={'warm_worker': False}",
        "train={gradient_checkpointing: true}",
        "grid={batch_size: [2]}",
    )
    default = load_study(REPO / "configs" / "config.yaml")
    default["grid"]["batch_size"] = [2]  # the override: one batch size, every other axis and exclusion kept
    assert (
        counts["finetune"]
        == len(expand_cells(default))
        == len(expand_cells(load_study(REPO / "configs" / "config.yaml"))) // 2
    )


def test_an_override_that_does_not_convert_names_the_key(tmp_path):
    from tunegrid.study.input import coerce_overrides

    with pytest.raises(ConfigError, match="train.steps"):
        resolve_study(make_study(train={"steps": coerce_overrides({"train": {"steps": "many"}})["train"]["steps"]}))


def test_hostile_study_files_fail_fast_with_a_clear_error(tmp_path):
    import subprocess
    import time

    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8)
    )
    cases = {
        "bomb.yaml": ("study: bomb\n" + bomb, "YAML aliases"),
        "long.yaml": ("study: long\nmodels: {m: {source: local, path: '" + "p" * 20_000 + "'}}\n", "models.m.path"),
        "huge.yaml": ("study: huge\n# " + "x" * 2_000_000 + "\n", "a study file is at most"),
    }
    for name, (text, expected) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        started = time.time()
        done = subprocess.run(
            snakemake_command(tmp_path, "-n", "--cores", "1", "all", "--configfile", str(path)),
            capture_output=True,
            text=True,
            timeout=60,
        )
        out = done.stdout + done.stderr
        assert done.returncode != 0 and "invalid study config" in out and expected in out, (name, out[-1500:])
        assert "Traceback" not in out, (name, out[-1500:])
        assert time.time() - started < 45, name  # a hang guard: a bomb walk takes minutes
        assert not (tmp_path / "results").exists()


def test_an_unknown_architecture_is_refused_before_any_job_runs():
    study = make_study()
    study["models"]["gemma3-hot"]["architecture"] = "not_a_model"
    with pytest.raises(ConfigError, match=r"models\.gemma3-hot\.architecture.*not_a_model"):
        resolve_study(study)


def test_jobs_get_the_study_by_file_never_on_the_command_line(tmp_path):
    import subprocess

    done = subprocess.run(
        snakemake_command(tmp_path, "-n", "-p", "--cores", "1", "all", "plan"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    contracts = [line for line in lines if "tunegrid.py cell-plan" in line]
    cells = [line for line in lines if "tunegrid.py finetune" in line]
    plans = [line for line in lines if "tunegrid.py plan" in line]
    # a cell's contract reads its resolved spec (the cell_config rule's file); its finetune job runs from the
    # contract; the plan table reads the resolved study and the contracts
    assert contracts and all(re.search(r"--spec-file results/default/specs/\S+\.json ", c) for c in contracts)
    assert cells and all(re.search(r"--contract results/default/plans/\S+\.json ", c) for c in cells)
    assert plans and all("--study-file results/default/study.json" in c for c in plans)
    assert not any('"axes"' in c or "--spec " in c or "--study '" in c for c in contracts + cells + plans)


def test_the_t4_study_plans_fp16_islands_and_its_target_runs_it_as_fp16(tmp_path):
    """fp16-islands runs on fp16 arithmetic: planned on a T4 target (native fp16), where bf16 is refused."""
    from tunegrid.targets import TARGETS, feasibility

    hardware = one_cell_spec(hardware={"refuse_emulated": True, "predicted_oom": "run", "oom_margin": 1.0}).hardware
    assert feasibility("fp16-islands", TARGETS["t4"], hardware, None) is None
    assert feasibility("bf16", TARGETS["t4"], hardware, None)[0] == "unsupported"
    assert _dry_run(tmp_path, "--configfile", str(REPO / "configs" / "gemma3-4b-t4-synthetic.yaml"))["finetune"] == 12
    study = load_study(REPO / "configs" / "gemma3-4b-t4.yaml")
    assert "fp16-islands" in study["grid"]["precision"] and study["review"]["reference"]["quant"] == "nf4"


def test_cells_at_once_ask_for_no_more_than_the_hosts_cores(tmp_path):
    """--cores 8 on a smaller host: each cell asks for its threads of a `host_cores` resource whose limit is
    the host's cores (common.smk registers it; a dry run does not print the limit), so cells running at
    once never share cores and their tokens/s stay comparable."""
    done = subprocess.run(
        snakemake_command(tmp_path, "-n", "--cores", "8", "all", "--config", "grid={batch_size: [2]}"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    blocks = done.stdout.split("\n\n")
    finetune = [b for b in blocks if "rule finetune:" in b]
    assert finetune and all("host_cores=1" in b for b in finetune), finetune[:1]


def test_the_probe_measures_all_reduce_at_the_grids_world_sizes_unless_the_study_names_its_own():
    """A study of one-process cells starts no all-reduce ranks; one with 2- and 4-rank cells measures both; a
    study's own `probe.world_sizes` is kept as written ([] measures none)."""
    from tunegrid.study.config import probe_world_sizes

    assert probe_world_sizes(resolve_study(make_study())) == []
    grid = {**make_study()["grid"], "world_size": [1, 4, 2]}
    assert probe_world_sizes(resolve_study(make_study(grid=grid))) == [2, 4]
    assert probe_world_sizes(resolve_study(make_study(grid=grid, probe={"world_sizes": []}))) == []
    assert probe_world_sizes(resolve_study(make_study(probe={"world_sizes": [8]}))) == [8]


@pytest.mark.slow
def test_a_prompt_format_with_braces_plans_and_writes_its_records(tmp_path):
    """A recipe's custom prompt format holds braces ("{instruction}"), which are no Snakemake wildcards: the
    dataset rule writes the records the format builds."""
    records = tmp_path / "data.jsonl"
    records.write_text('{"q": "What is 2+2?", "ctx": "arithmetic", "a": "4"}\n' * 8)
    raw = make_study()
    raw["data"] = {
        "source": "jsonl",
        "path": str(records),
        "layout": {
            "field_instruction": "q",
            "field_input": "ctx",
            "field_output": "a",
            "format": "Q: {instruction} [{input}]\n",
        },
    }
    config = tmp_path / "braces.yaml"
    config.write_text(yaml.safe_dump(raw))
    done = subprocess.run(
        snakemake_command(tmp_path, "results/t/data/train.jsonl", "--cores", "1", "--configfile", str(config)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    first = json.loads((tmp_path / "results" / "t" / "data" / "train.jsonl").read_text().splitlines()[0])
    assert "Q: What is 2+2? [arithmetic]" in json.dumps(first), first
