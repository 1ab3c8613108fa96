"""The study's own data: jsonl chats and parquet pairs through the cell runner, and the config checks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import REPO, make_study, run_supervised, work_cell

from tunegrid.dataset import read_dataset
from tunegrid.prepare.datasets_io import DataError, write_study_dataset
from tunegrid.runtime.files import read_json, read_jsonl
from tunegrid.study.config import ConfigError, cell_spec, expand_cells, resolve_study

CHAT_FILE = REPO / "examples" / "chat.jsonl"
PINNED = "0123456789abcdef0123456789abcdef01234567"


def _study(data: dict, model: str = "qwen3moe-tiny", steps: int = 4, seq_len: int = 128) -> dict:
    grid = {"model": [model], "precision": ["fp32"], "batch_size": [2], "quant": ["none"], "seed": [0]}
    return resolve_study(make_study(grid=grid, train={"steps": steps, "seq_len": seq_len, "lr": 0.01}, data=data))


def _problems(data: dict) -> str:
    with pytest.raises(ConfigError) as caught:
        resolve_study(make_study(data=data))
    return str(caught.value)


def _any_problems(data: dict) -> str:
    try:
        resolve_study(make_study(data=data))
    except ConfigError as exc:
        return str(exc)
    return ""


@pytest.mark.slow
def test_chat_jsonl_trains_packed_through_the_cell_runner(checkpoints, tmp_path):
    study = _study({"source": "jsonl", "path": str(CHAT_FILE), "fields": {"messages": "messages"}})
    data_path = tmp_path / "train.jsonl"
    assert write_study_dataset(data_path, study["data"]) == 200
    assert all("messages" in r for r in read_dataset(data_path))
    spec = cell_spec(study, expand_cells(study)[0]).to_json()
    run_dir = tmp_path / "runs" / spec["cell_id"]
    result = run_supervised(spec, checkpoints, data_path, run_dir)
    assert result["outcome"] == "ok", result["reason"]
    saved = read_json(run_dir / "result.json")
    assert saved["data"]["packing"] == "position_ids"
    assert saved["data"]["source"] == "jsonl" and saved["data"]["examples"] == 200
    assert saved["data"]["rows"] < 200 and saved["data"]["fill"] > 0.8  # several chats per 128-token row
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert len(records) == 4 and all(math.isfinite(r["loss"]) for r in records)
    # tokens_per_s counts real tokens: at most the batch's capacity, and more than a padded chat would give
    tokens = [r["tokens_per_s"] * r["step_time_s"] for r in records]
    assert all(2 * 128 * 0.6 < t <= 2 * 128 + 1e-6 for t in tokens), tokens


def test_parquet_pairs_train_with_their_own_field_names(checkpoints, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    questions = [f"Spell {w} backwards." for w in ("stone", "river", "cloud", "amber", "maple")] * 8
    table = pa.table({"question": questions, "answer": [q.split()[1][::-1] for q in questions], "id": list(range(40))})
    pq.write_table(table, tmp_path / "pairs.parquet")
    study = _study(
        {
            "source": "parquet",
            "path": str(tmp_path / "pairs.parquet"),
            "fields": {"prompt": "question", "response": "answer"},
        },
        model="gemma3-hot",
        seq_len=64,
    )
    data_path = tmp_path / "train.jsonl"
    write_study_dataset(data_path, study["data"])
    assert read_dataset(data_path)[0] == {"instruction": "Spell stone backwards.", "response": "enots"}
    spec = cell_spec(study, expand_cells(study)[0]).to_json()
    work_cell(spec, checkpoints["gemma3-hot"], data_path, tmp_path / "run")
    facts = read_json(tmp_path / "run" / "worker.json")
    assert facts["outcome"] == "ok", facts["reason"]
    assert facts["data"]["packing"] == "position_ids" and facts["data"]["template"] == "prompt_template"
    assert facts["data"]["examples"] == 40


def test_missing_file_names_data_path(tmp_path):
    message = _problems({"source": "jsonl", "path": str(tmp_path / "nope.jsonl"), "fields": {"messages": "messages"}})
    assert "'data.path'" in message and "Traceback" not in message


def test_missing_field_names_the_field_key(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": "a"}) + "\n" for i in range(5)))
    message = _problems({"source": "jsonl", "path": str(path)})  # default fields: prompt/response
    assert "'data.fields.response'" in message and "'response'" in message


def test_missing_parquet_column_names_the_field_key(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"q": ["a"], "response": ["b"]}), tmp_path / "p.parquet")
    assert "'data.fields.prompt'" in _problems({"source": "parquet", "path": str(tmp_path / "p.parquet")})


def test_a_record_past_the_config_sample_is_still_checked_when_the_set_is_written(tmp_path):
    path = tmp_path / "pairs.jsonl"
    rows = [{"prompt": "q", "response": "a"}] * 150 + [{"prompt": "q"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    study = resolve_study(make_study(data={"source": "jsonl", "path": str(path)}))  # the sample is fine
    with pytest.raises(DataError, match="'data.fields.response'"):
        write_study_dataset(tmp_path / "train.jsonl", study["data"])


def test_chats_that_are_not_role_content_lists_are_refused(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "text": "hi"}]}) + "\n")
    assert "'data.fields.messages'" in _problems(
        {"source": "jsonl", "path": str(path), "fields": {"messages": "messages"}}
    )


def test_hub_dataset_revision_is_pinned_or_left_to_the_fetch():
    assert not _any_problems({"source": "hub", "repo_id": "someone/chats"}), "unpinned: the dataset rule resolves it"
    assert "'data.revision'" in _problems({"source": "hub", "repo_id": "someone/chats", "revision": "main"})
    assert "'data.repo_id'" in _problems({"source": "hub", "revision": PINNED})


def test_pinned_hub_dataset_passes_validation():
    # Only validation can be tested here: reading the records (datasets.load_dataset at that revision,
    # with HF_TOKEN from the environment) needs the hub.
    study = resolve_study(
        make_study(
            data={
                "source": "hub",
                "repo_id": "someone/chats",
                "revision": PINNED,
                "fields": {"messages": "conversation"},
            }
        )
    )
    assert study["data"]["packing"] is True and study["data"]["split"] == "train"


def test_pairs_fields_need_prompt_and_response(tmp_path):
    assert "'data.fields'" in _problems({"source": "jsonl", "path": str(CHAT_FILE), "fields": {"prompt": "messages"}})


def test_synthetic_data_is_the_default_and_needs_no_file():
    study = resolve_study(make_study())
    assert study["data"]["source"] == "synthetic" and study["data"]["packing"] is True
    assert study["data"]["loss_on"] == "response"


def test_dataset_command_reports_a_bad_source_as_a_config_error(tmp_path, capsys):
    from tunegrid.cli import main

    spec = {"source": "jsonl", "path": str(tmp_path / "missing.jsonl"), "fields": {"messages": "m"}}
    assert main(["dataset", "--data-spec", json.dumps(spec), "--out", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "'data.path'" in err and "Traceback" not in err and not Path(tmp_path / "o.jsonl").exists()


def test_an_empty_data_file_is_refused_at_validation(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    for name in ("empty.jsonl", "blank.jsonl"):
        message = _problems({"source": "jsonl", "path": str(tmp_path / name)})
        assert "'data.path'" in message and "no records" in message and name in message

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"prompt": pa.array([], pa.string()), "response": pa.array([], pa.string())}), tmp_path / "e.parquet"
    )
    assert "no records" in _problems({"source": "parquet", "path": str(tmp_path / "e.parquet")})


@pytest.mark.parametrize("bad_line", [17, 142])  # inside the sample validation reads, and past it
@pytest.mark.parametrize("defect", ["trailing", "truncated", "not_an_object", "missing_field"])
def test_a_bad_json_line_is_named_by_file_and_1_based_line(tmp_path, bad_line, defect):
    good = json.dumps({"prompt": "q", "response": "a"})
    bad = {
        "trailing": good + ' {"x": 1}',
        "truncated": good[:-5],
        "not_an_object": "[1, 2]",
        "missing_field": json.dumps({"prompt": "q"}),
    }[defect]
    path = tmp_path / "pairs.jsonl"
    lines = [good] * 200
    lines[bad_line - 1] = bad
    lines.insert(3, "")  # blank lines still count: the number is the file's own line number
    path.write_text("\n".join(lines) + "\n")
    where = f"{str(path)!r} line {bad_line + 1}"
    data = {"source": "jsonl", "path": str(path)}
    if bad_line <= 100:  # within the records validation samples: refused before any job runs
        message = _problems(data)
    else:
        study = resolve_study(make_study(data=data))
        with pytest.raises(DataError) as caught:
            write_study_dataset(tmp_path / "train.jsonl", study["data"])
        message = str(caught.value)
    assert where in message, message
    assert {
        "trailing": "Extra data",
        "truncated": "column",
        "not_an_object": "not an object",
        "missing_field": "no field 'response'",
    }[defect] in message, message
    assert good[:10] not in message  # the line's text is not echoed


def test_data_path_outside_the_project_is_refused_even_through_a_symlink(tmp_path, monkeypatch):
    """A study reads data from the folder it runs in (or folders the runner lists in TUNEGRID_DATA_ROOTS),
    never from wherever a study file points: a symlink inside the project to a file outside is refused."""
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir(), elsewhere.mkdir()
    secret = elsewhere / "secrets.jsonl"
    secret.write_text(json.dumps({"prompt": "q", "response": "a"}) + "\n")
    (project / "data.jsonl").symlink_to(secret)
    (project / "own.jsonl").write_text(secret.read_text())
    monkeypatch.chdir(project)
    monkeypatch.delenv("TUNEGRID_DATA_ROOTS", raising=False)
    for given in ("data.jsonl", str(secret), "../elsewhere/secrets.jsonl"):
        message = _problems({"source": "jsonl", "path": given})
        assert "'data.path'" in message and "outside the project folder" in message, message
    assert "through a symlink" in _problems({"source": "jsonl", "path": "data.jsonl"})
    assert _any_problems({"source": "jsonl", "path": "own.jsonl"}) == ""
    monkeypatch.setenv("TUNEGRID_DATA_ROOTS", str(elsewhere))  # the runner's choice, not the study's
    assert _any_problems({"source": "jsonl", "path": "data.jsonl"}) == ""
