"""The probe's calibration kept per machine and software stack (tunegrid.run.calibration_cache): measured once,
measured again whenever what it depends on changes, never kept in part, and never in the way of the probe."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tunegrid.run import calibration_cache
from tunegrid.run.calibration_cache import calibrated, source_digest

CPU = {"model": "Some CPU", "isa_flags": ["avx2"], "cores": 2}
WHOLE = {
    "spawned": {"fp32": 478_000_000, "bf16": 502_000_000, "fp16": 480_000_000},
    "forked": {"fp32": 401_000_000, "bf16": 426_000_000, "fp16": 404_000_000},
    "seconds": 7.4,
}


class Measure:
    def __init__(self, result=WHOLE):
        self.calls = 0
        self.result = result

    def __call__(self):
        self.calls += 1
        return json.loads(json.dumps(self.result))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TUNEGRID_CACHE", str(tmp_path / "cache"))
    for name in calibration_cache.ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "cache"


def test_measured_once_then_taken_from_the_cache(cache):
    measure = Measure()
    first = calibrated(measure, CPU, 2)
    second = calibrated(measure, CPU, 2)
    assert measure.calls == 1
    assert first["cache"] == "filled" and second["cache"] == "hit"
    assert {k: v for k, v in second.items() if k != "cache"} == WHOLE


@pytest.mark.parametrize(
    "change",
    ["threads", "cpu", "allocator", "package"],
)
def test_anything_it_depends_on_changes_and_it_is_measured_again(cache, monkeypatch, change):
    measure = Measure()
    calibrated(measure, CPU, 2)
    cpu, threads = CPU, 2
    if change == "threads":
        threads = 1
    elif change == "cpu":
        cpu = {**CPU, "isa_flags": ["avx2", "avx512_bf16"]}
    elif change == "allocator":
        monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    else:
        real = calibration_cache.importlib.metadata.version
        monkeypatch.setattr(
            calibration_cache.importlib.metadata,
            "version",
            lambda name: "99.0" if name == "transformers" else real(name),
        )
    assert calibrated(measure, cpu, threads)["cache"] == "filled"
    assert measure.calls == 2


def test_the_source_digest_follows_every_file_of_the_package(tmp_path):
    package = tmp_path / "pkg"
    (package / "room").mkdir(parents=True)
    (package / "room" / "a.py").write_text("x = 1\n")
    before = source_digest(package)
    (package / "room" / "a.py").write_text("x = 2\n")
    assert source_digest(package) != before
    assert len(source_digest()) == 64


def test_a_calibration_in_part_is_never_kept(cache):
    partial = {**WHOLE, "forked": {}}  # the warm worker did not serve: the spawned path alone
    measure = Measure(partial)
    assert calibrated(measure, CPU, 2)["cache"] == "not kept"
    assert calibrated(measure, CPU, 2)["cache"] == "not kept"
    assert measure.calls == 2


def test_off_measures_every_time(monkeypatch):
    monkeypatch.setenv("TUNEGRID_CACHE", "off")
    measure = Measure()
    assert calibrated(measure, CPU, 2)["cache"] == "off"
    assert calibrated(measure, CPU, 2)["cache"] == "off"
    assert measure.calls == 2


def test_a_damaged_entry_is_measured_and_written_again(cache, capfd):
    measure = Measure()
    calibrated(measure, CPU, 2)
    (entry,) = (cache / "calibration").iterdir()
    entry.write_text("{not json")
    assert calibrated(measure, CPU, 2)["cache"] == "filled"
    assert "cannot be read" in capfd.readouterr().err
    assert calibrated(measure, CPU, 2)["cache"] == "hit"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_cache_that_cannot_be_written_leaves_the_probe_its_measurement(cache, capfd):
    cache.mkdir()
    cache.chmod(0o500)
    try:
        result = calibrated(Measure(), CPU, 2)
    finally:
        cache.chmod(0o700)
    assert result["cache"] == "not kept" and result["spawned"] == WHOLE["spawned"]
    assert "cannot write" in capfd.readouterr().err


def test_an_unwritable_cache_path_leaves_the_probe_its_measurement(tmp_path, monkeypatch, capfd):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("TUNEGRID_CACHE", str(blocker))  # a file where the folder should be: works for root too
    result = calibrated(Measure(), CPU, 2)
    assert result["cache"] == "not kept" and result["forked"] == WHOLE["forked"]
    assert "cannot write" in capfd.readouterr().err
    assert Path(blocker).read_text() == "not a folder"
