"""The flight recorder read as data (tunegrid.run.recorder_read): NVIDIA Resiliency Extension's four 16-rank dump
sets, each against its reference verdict (tests/data/flight_recorder/nvrx/SOURCE.md), a gloo job's dumps as a
cell's ranks name them, and the folders a failing job leaves (a rank without a dump, a truncated, empty or foreign
file, a stray pipe, host names in file names, mixed versions, nothing at all): each a typed status, never a crash."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest

from tunegrid.diagnosis import RecorderReading
from tunegrid.run.recorder_read import STATUSES, dump_files, main, read

DATA = Path(__file__).resolve().parents[1] / "data" / "flight_recorder"
SETS = ("gpu_error_1st", "gpu_error_2nd", "lock_gil_1st", "lock_gil_2nd")


def _reference(name: str) -> dict[str, set[int]]:
    """NVRx's reference summary: process group id -> the ranks missing in it."""
    lines = (DATA / "nvrx" / "reference_outputs" / f"{name}_reference.txt").read_text().splitlines()[1:]
    rows = [[cell.strip() for cell in line.split("|")] for line in lines if line.strip()]
    return {row[0]: {int(r) for r in row[-1].split(",")} for row in rows}


def _copy(tmp_path: Path, name: str, drop: tuple[int, ...] = ()) -> Path:
    folder = tmp_path / name
    shutil.copytree(DATA / "nvrx" / name, folder)
    for rank in drop:
        (folder / f"_dump_{rank}").unlink()
    return folder


@pytest.mark.parametrize("name", SETS)
def test_each_nvrx_set_reads_as_its_reference_verdict(name):
    reading = RecorderReading.from_json(read(DATA / "nvrx" / name, 16))
    reference = _reference(name)
    assert reading.status == "found" and reading.first is not None
    assert reading.first.collective == "nccl:all_to_all" and reading.first.mismatch is None
    assert reading.first.group in reference and "EXPERT_MODEL_PARALLEL_GROUP" in reading.first.group_desc
    assert set(reading.first.missing_ranks) == reference[reading.first.group]
    assert set(reading.suspect_ranks) == set().union(*reference.values())
    assert not reading.mismatch  # ranks that did not arrive: never a mismatch
    assert reading.record["ignored"] == ["fault_injection.log"]


def test_the_nvrx_sets_name_group_collective_and_sequence_number():
    first = {name: RecorderReading.from_json(read(DATA / "nvrx" / name, 16)).first for name in SETS}
    assert [(f.group, f.seq, f.missing_ranks) for f in first.values()] == [
        ("74", 20537, [12]),
        ("72", 44791, [9, 14]),
        ("72", 45265, [9, 14]),
        ("74", 20947, [15]),
    ]
    lock_gil_2nd = RecorderReading.from_json(read(DATA / "nvrx" / "lock_gil_2nd", 16))
    assert lock_gil_2nd.empty_dumps == [10, 15]  # NVRx's 73/10 is the rank whose dump holds no entry


def test_a_gloo_jobs_dumps_as_a_cells_ranks_name_them_read_despite_torchs_keyerror():
    reading = RecorderReading.from_json(read(DATA / "gloo", 2))
    assert reading.status == "found", reading.note
    assert (reading.first.group_desc, reading.first.collective, reading.first.seq) == (
        "0:default_pg",
        "gloo:all_reduce",
        4,
    )
    assert reading.first.missing_ranks == [1] and reading.suspect_ranks == [1]
    assert "named from the entries" in reading.note


@pytest.mark.parametrize(
    ("drop", "without"),
    [((12,), [12]), ((10, 15), [10, 15])],
)
def test_a_rank_without_a_dump_is_incomplete_and_named_never_a_mismatch(tmp_path, drop, without):
    name = "gpu_error_1st" if drop == (12,) else "lock_gil_2nd"
    reading = RecorderReading.from_json(read(_copy(tmp_path, name, drop), 16))
    assert reading.status == "incomplete" and reading.ranks_without_dumps == without
    assert set(without) <= set(reading.suspect_ranks) and not reading.mismatch
    assert "no verdict" in reading.line()


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda path: path.write_bytes(path.read_bytes()[: path.stat().st_size // 2]), "UnpicklingError"),
        (lambda path: path.write_bytes(b""), "EOFError"),
        (lambda path: path.write_bytes(b"not a pickle"), "UnpicklingError"),
    ],
    ids=["truncated", "zero-byte", "garbage"],
)
def test_a_dump_that_does_not_read_is_that_ranks_missing_dump(tmp_path, damage, why):
    folder = _copy(tmp_path, "gpu_error_1st")
    damage(folder / "_dump_13")
    reading = RecorderReading.from_json(read(folder, 16))
    assert reading.status == "incomplete" and reading.ranks_without_dumps == [13]
    assert why in reading.note and "rank 13" in reading.note


def test_other_files_a_pipe_and_host_names_are_left_out_or_read(tmp_path):
    folder = _copy(tmp_path, "gpu_error_1st")
    shutil.copy(folder / "_dump_0", folder / "_dump_0.bak")
    os.mkfifo(folder / "rank_0.pipe")  # torch's on-demand dump pipe: opening it would block
    (folder / "_dump_3").rename(folder / "host-a_dump_3")
    files, ignored = dump_files(folder)
    assert sorted(files) == list(range(16)) and files[3].name == "host-a_dump_3"
    assert ignored == ["_dump_0.bak", "fault_injection.log", "rank_0.pipe"]
    reading = RecorderReading.from_json(read(folder, 16))
    assert reading.status == "found" and reading.first.missing_ranks == [12]


def test_mixed_versions_an_empty_folder_and_too_many_mismatches_are_marked(tmp_path, capsys):
    folder = _copy(tmp_path, "gpu_error_1st")
    dump = pickle.loads((folder / "_dump_5").read_bytes())
    (folder / "_dump_5").write_bytes(pickle.dumps({**dump, "version": "2.4"}))
    failed = RecorderReading.from_json(read(folder, 16))
    assert failed.status == "failed" and "different version" in failed.note and failed.first is None
    empty = tmp_path / "empty"
    empty.mkdir()
    assert read(empty, 2)["status"] == "no_dumps"
    aborted = RecorderReading.from_json(read(DATA / "nvrx" / "gpu_error_2nd", 16, mismatch_cap=10))
    assert aborted.status == "too_many_mismatches" and "Too many mismatches" in aborted.note
    assert aborted.first.missing_ranks == [9, 14] and not aborted.mismatch  # kept as evidence, no verdict
    assert main([str(tmp_path / "no-such-folder")]) == 0  # the command answers even then
    assert '"status": "no_dumps"' in capsys.readouterr().out
    assert set(STATUSES) == {"found", "none_failed", "incomplete", "too_many_mismatches", "no_dumps", "failed"}


def test_a_reading_from_before_the_statuses_reads_as_failed_with_its_line():
    old = {"dumps": ["rank_0"], "verdict": "KeyError: ('0', 0)", "report_tail": []}
    reading = RecorderReading.from_json(old)
    assert reading.status == "failed" and reading.note == "KeyError: ('0', 0)" and not reading.suspect_ranks
