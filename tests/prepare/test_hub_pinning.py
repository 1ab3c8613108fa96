"""Unpinned hub ids (a recipe as its author wrote it): the checkpoint and dataset rules resolve the branch to
its commit when they fetch and record it (manifest.json, train.source.json), the cell result, its MLflow tags
and the report's header read it, `tunegrid pin` writes it back, and offline without a cached copy the fetch
fails naming the model and how to give it locally. No hub is reached: `HubStandIn` takes its place."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import one_cell_spec

from tunegrid.cli.main import main
from tunegrid.outcome import CellResult
from tunegrid.prepare import hub
from tunegrid.prepare.checkpoints import CheckpointError, download_hub
from tunegrid.study.config import resolve_study
from tunegrid.study.sources import fetched_env, fetched_sources
from tunegrid.track.tags import run_tags

COMMIT = "0123456789abcdef0123456789abcdef01234567"
CHAT = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}


class HubStandIn:
    """A stand-in for the Hugging Face hub in tests only: it is not the hub, it serves one commit per ref and
    a one-tensor checkpoint, and it says so in its name."""

    name = "hub stand-in (tests only, not the Hugging Face hub)"

    def __init__(self, offline: bool = False) -> None:
        self.offline = offline
        self.asked: list[tuple[str, str, str]] = []

    def commit_of(self, kind: str, repo_id: str, ref: str) -> str:
        self.asked.append((kind, repo_id, ref))
        if self.offline:
            raise ConnectionError("stand-in: no network")
        return COMMIT

    def snapshot(self, repo_id: str, revision: str, patterns: list[str], out_dir: Path) -> None:
        import torch
        from safetensors.torch import save_file

        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps({"model_type": "llama", "stand_in": self.name}))
        save_file({"w": torch.zeros(2)}, str(out_dir / "model.safetensors"))


@pytest.fixture
def stand_in(monkeypatch, tmp_path) -> HubStandIn:
    client = HubStandIn()
    monkeypatch.setattr(hub, "HUB", client)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    return client


def test_an_unpinned_model_is_fetched_at_its_refs_commit_and_the_manifest_records_it(stand_in, tmp_path):
    manifest = download_hub({"repo_id": "org/m", "revision": "", "ref": "main"}, tmp_path / "m")
    assert manifest["source"] == {"kind": "hub", "repo_id": "org/m", "revision": COMMIT, "pinned": False, "ref": "main"}
    assert stand_in.asked == [("model", "org/m", "main")]
    pinned = download_hub({"repo_id": "org/m", "revision": "f" * 40}, tmp_path / "p")
    assert pinned["source"]["pinned"] is True and len(stand_in.asked) == 1, "a pinned revision is not looked up"


def test_remote_code_of_an_unpinned_model_waits_for_a_pin(stand_in, tmp_path):
    with pytest.raises(CheckpointError, match=rf"trust_remote_code.*fetched at {COMMIT}.*tunegrid pin"):
        download_hub({"repo_id": "org/m", "revision": "", "trust_remote_code": True}, tmp_path / "m", "models.m")


def test_offline_without_a_cached_copy_names_the_model_and_how_to_give_it_locally(stand_in, tmp_path):
    stand_in.offline = True
    with pytest.raises(CheckpointError) as caught:
        download_hub({"repo_id": "org/m", "revision": "", "ref": "main"}, tmp_path / "m", "models.m")
    message = str(caught.value)
    assert "org/m" in message and "source: local" in message and "--model" in message and "\n" not in message
    refs = tmp_path / "hub-cache" / "models--org--m" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text("a" * 40)  # a copy the hub cache holds: offline resolves to its commit
    assert download_hub({"repo_id": "org/m", "revision": ""}, tmp_path / "c")["source"]["revision"] == "a" * 40


def test_an_unpinned_dataset_is_read_at_its_commit_and_the_commit_is_written_beside_it(stand_in, tmp_path, monkeypatch):
    import datasets

    read: dict = {}

    class Table:
        def to_list(self):
            return [CHAT]

    def load_dataset(repo_id, revision=None, split=None, token=None):
        read.update(repo_id=repo_id, revision=revision, split=split)
        return Table()

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    from tunegrid.prepare.datasets_io import write_study_dataset

    data = {"source": "hub", "repo_id": "org/chats", "revision": "", "ref": "main", "split": "train",
            "fields": {"messages": "messages"}, "path": ""}  # fmt: skip
    assert write_study_dataset(tmp_path / "data" / "train.jsonl", data) == 1
    assert read == {"repo_id": "org/chats", "revision": COMMIT, "split": "train"}
    sidecar = json.loads((tmp_path / "data" / "train.source.json").read_text())
    assert sidecar == {"kind": "hub", "repo_id": "org/chats", "revision": COMMIT, "pinned": False, "ref": "main"}


def test_the_result_mlflow_tags_and_report_header_say_not_pinned_fetched_at(stand_in, tmp_path):
    study_dir = tmp_path / "results" / "s"
    download_hub({"repo_id": "org/m", "revision": ""}, study_dir / "models" / "m")
    (study_dir / "data").mkdir(parents=True)
    (study_dir / "data" / "train.jsonl").write_text(json.dumps(CHAT) + "\n")
    env = fetched_env(study_dir / "models" / "m", study_dir / "data" / "train.jsonl")
    assert env == {"model_source": {"repo_id": "org/m", "revision": COMMIT, "pinned": False}}
    tags = run_tags(CellResult(cell_id="c", cell=one_cell_spec(), outcome="ok", reason="", env=env))
    assert tags["model.revision"] == COMMIT and tags["model.pinned"] == "false"
    assert fetched_sources(study_dir) == [f"model m: org/m: not pinned; fetched at {COMMIT} ('main')"]


def test_tunegrid_pin_writes_the_fetched_commits_back_into_the_study(stand_in, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = {"base_model": "org/m", "adapter": "lora", "sequence_len": 256, "micro_batch_size": 1,
              "datasets": [{"path": "org/chats", "type": "chat_template"}]}  # fmt: skip
    Path("r.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["import", "r.yaml", "--failure", "nan", "--out", "configs/r.yaml"]) == 0
    study = yaml.safe_load(Path("configs/r.yaml").read_text())
    (name,) = study["models"]
    download_hub(study["models"][name], Path("results") / "r" / "models" / name)
    assert main(["pin", "configs/r.yaml"]) == 0
    pinned = yaml.safe_load(Path("configs/r.yaml").read_text())
    assert pinned["models"][name]["revision"] == COMMIT and "ref" not in pinned["models"][name]
    assert pinned["data"]["revision"] == "", "the dataset was not fetched yet: left unpinned, and said"
    assert Path("configs/r.yaml").read_text().startswith("# Imported from r.yaml")
    resolve_study(pinned)
