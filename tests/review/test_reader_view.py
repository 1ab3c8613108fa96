"""What a reader of the results gets: files with the user's umask, commands that run as printed, one spelling
per module."""

from __future__ import annotations

import os
import stat

import pytest

from tunegrid.runtime.files import atomic_write_text, write_json, write_text_if_changed
from tunegrid.study.paths import StudyPaths


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_atomic_writes_take_the_users_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        write_json(tmp_path / "result.json", {"outcome": "ok"})
        atomic_write_text(tmp_path / "report" / "index.html", "<html></html>")
        write_text_if_changed(tmp_path / "summary.csv", "cell_id\n")
    finally:
        os.umask(old)
    for name in ("result.json", "report/index.html", "summary.csv"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == mode, name
    assert sorted(p.name for p in tmp_path.rglob(".*.tmp")) == []  # no temp file left behind


def test_files_safetensors_wrote_private_are_opened_to_the_umask(tmp_path):
    import torch
    from safetensors.torch import save_file

    from tunegrid.runtime.files import open_to_umask

    folder, users = tmp_path / "adapter", tmp_path / "users"
    folder.mkdir()
    users.mkdir()
    save_file({"a": torch.zeros(2)}, str(folder / "adapter_model.safetensors"))
    assert stat.S_IMODE((folder / "adapter_model.safetensors").stat().st_mode) == 0o600  # the library's own mode
    theirs = users / "model.safetensors"
    theirs.write_bytes(b"x")
    theirs.chmod(0o600)
    (folder / "linked.safetensors").symlink_to(theirs)  # a user's own file, linked (a local checkpoint)
    old = os.umask(0o022)
    try:
        open_to_umask(folder)
    finally:
        os.umask(old)
    assert stat.S_IMODE((folder / "adapter_model.safetensors").stat().st_mode) == 0o644
    assert stat.S_IMODE(theirs.stat().st_mode) == 0o600  # never changed through the link


def test_the_reports_export_command_names_the_study_folder():
    """What the report prints for a recipe's fix parses as the CLI's export command (--study-dir is required)."""
    import shlex

    from tunegrid.cli.main import build_parser
    from tunegrid.recipes.export import export_command

    command = export_command("gemma3-tiny_fp32_bs8_nf4_s0", "axolotl", StudyPaths.of("my study").study_dir)
    args = build_parser().parse_args(shlex.split(command)[1:])
    assert args.cell_id == "gemma3-tiny_fp32_bs8_nf4_s0" and args.to == "axolotl"
    assert args.study_dir == "results/my study"


def test_a_module_is_spelled_one_way_on_every_line_of_the_report():
    """peft's wrapper prefix goes; the model's own name stays (what a study's inject/islands keys are written in)."""
    from tunegrid.cell.loop.records import origin_text
    from tunegrid.outcome import module_name, origin_label
    from tunegrid.review.recommend import _short

    wrapped = "base_model.model.model.layers.0.mlp.down_proj"
    plain = "model.layers.0.mlp.down_proj"
    fact = {"module": wrapped, "at": "real", "preceded_by": {"module": wrapped, "at": "padding"}}
    assert module_name(wrapped) == plain and module_name(plain) == plain
    assert origin_label(fact) == plain  # summary.csv and the MLflow tags
    assert _short(wrapped) == plain and _short(plain) == plain  # the recommendation's sentence
    assert origin_text(fact) == f"{plain} (after a non-finite value at padding positions of {plain})"  # the reason


def test_the_reports_cell_names_and_run_ids_link_to_the_run_in_mlflows_view_of_training_runs(tmp_path):
    import pandas as pd

    from tunegrid.review.report_format import cell_html
    from tunegrid.review.run_links import CellLinks, mlflow_run_base
    from tunegrid.runtime.files import write_json

    study, tracking = tmp_path / "study.json", tmp_path / "tracking.json"
    write_json(study, {"tracking": {"enabled": True, "ui_host": "127.0.0.1", "ui_port": 5001}})
    write_json(tracking, {"experiment_id": "7"})
    base = mlflow_run_base(study, tracking)
    assert base == "http://127.0.0.1:5001/#/experiments/7/runs/"
    frame = pd.DataFrame([{"cell_id": "c", "mlflow_run_id": "abc123"}, {"cell_id": "d", "mlflow_run_id": None}])
    links = CellLinks(frame, base)
    href = f"{base}abc123?workflowType=machine_learning"
    row = {"mlflow_run_id": "abc123", "cell_id": "c"}
    assert cell_html(row, "mlflow_run_id", links) == f"<td><a href='{href}'>abc123</a></td>"
    assert cell_html(row, "cell_id", links) == f"<td><a class='cell' href='{href}'>c</a></td>"
    assert links.cell("d") == "d", "a cell without a run stays plain text"
    write_json(study, {"tracking": {"enabled": False}})
    assert mlflow_run_base(study, tracking) is None
    assert cell_html(row, "mlflow_run_id", CellLinks(frame, None)) == "<td>abc123</td>"
    assert CellLinks(frame, None).cell("c") == "c"
