"""One GPU per rank by default, and one job per GPU: what a cell's job asks the scheduler for is what its
ranks train on, and local jobs side by side never share a device. Decided on CPU from the H100 probe record,
fake driver folders and real file locks."""

from __future__ import annotations

import threading

from conftest import REPO, one_cell_spec

from tunegrid.run.launch import child_env
from tunegrid.runtime.devices import cell_devices, cell_gpus, claimed_devices, gpus_per_rank, visible_gpu_count
from tunegrid.runtime.files import read_json

H100 = read_json(REPO / "tests" / "data" / "capabilities-h100.json")  # recorded on a one-GPU machine
CPU = {"device": "cpu", "gpus": []}


def test_a_study_that_does_not_set_gpus_per_rank_asks_for_one_per_rank_where_the_probe_found_cuda(tmp_path):
    from tunegrid.targets import gpu_shortfall

    spec = one_cell_spec(world=2)
    assert spec.hardware.gpus_per_rank == "auto"
    assert cell_gpus("auto", 2, H100) == 2 and cell_gpus("auto", 2, CPU) == 0
    # and so "more ranks than GPUs" holds without the study saying gpus_per_rank: 1
    verdict = gpu_shortfall(spec, H100)
    assert verdict is not None and verdict[0] == "unsupported", verdict
    assert "needs 2 GPUs (world_size 2 x gpus_per_rank 1), 1 present" in verdict[1]


def test_auto_before_the_probe_counts_the_driver_devices_narrowed_by_cuda_visible_devices(tmp_path):
    driver = tmp_path / "gpus"
    for bus in ("0000:17:00.0", "0000:65:00.0"):
        (driver / bus).mkdir(parents=True)
    assert visible_gpu_count({}, driver) == 2
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "1"}, driver) == 1
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": ""}, driver) == 0
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "-1"}, driver) == 0
    assert visible_gpu_count({}, tmp_path / "no-driver") == 0
    assert gpus_per_rank(0, H100) == 0 and gpus_per_rank(1, CPU) == 1


def test_jobs_side_by_side_claim_different_gpus_and_a_third_waits_for_one(tmp_path):
    locks = tmp_path / "locks"
    waiting, got = threading.Event(), []

    def third() -> None:
        with claimed_devices(1, ["0", "1"], locks, on_wait=lambda _: waiting.set()) as devices:
            got.extend(devices)

    with claimed_devices(1, ["0", "1"], locks) as first:
        with claimed_devices(1, ["0", "1"], locks) as second:
            assert first != second and sorted(first + second) == ["0", "1"]
            thread = threading.Thread(target=third)
            thread.start()
            assert waiting.wait(30), "a job finding every GPU held waits, never shares one"
            assert got == []
        thread.join(30)  # the second job ended: its device is free again
    assert got == second


def test_a_cell_trains_on_its_own_claimed_gpu_or_on_the_cpu_when_it_asks_for_none(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    two_gpus = {**H100, "gpus": H100["gpus"] * 2}
    with cell_devices("auto", 1, two_gpus, tmp_path) as first, cell_devices("auto", 1, two_gpus, tmp_path) as second:
        assert {first, second} == {"0", "1"}
        assert child_env(first)["CUDA_VISIBLE_DEVICES"] == first
    with cell_devices("auto", 2, two_gpus, tmp_path) as both:
        assert both == "0,1"  # rank r trains on the r-th of them
    with cell_devices(0, 1, two_gpus, tmp_path) as none:
        assert none == "" and child_env(none)["CUDA_VISIBLE_DEVICES"] == ""  # the worker sees no CUDA device
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    with cell_devices("auto", 2, two_gpus, tmp_path) as granted:
        assert granted is None  # the cluster granted this job its GPUs: nothing to claim


def test_on_slurm_a_two_rank_cell_is_judged_by_the_gpus_its_own_job_was_granted(monkeypatch):
    """The probe job asked for one rank's GPU, so its record lists 1: that is no reason to refuse a 2-rank cell
    whose job was granted 2 (it used to end every world_size > 1 cell `unsupported` on SLURM)."""
    import tunegrid.runtime.devices
    from tunegrid.targets import gpu_shortfall

    probe_job = {**H100, "cluster_job": True}  # the record as a SLURM probe job writes it: 1 GPU, its own
    spec = one_cell_spec(world=2)
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setattr(tunegrid.runtime.devices, "visible_gpu_count", lambda: 2)  # the cell's job: --gpus=2
    assert gpu_shortfall(spec, probe_job) is None
    monkeypatch.setattr(tunegrid.runtime.devices, "visible_gpu_count", lambda: 1)  # a job granted too few
    verdict = gpu_shortfall(spec, probe_job)
    assert verdict is not None and "1 granted to this job" in verdict[1]
    monkeypatch.delenv("SLURM_JOB_ID")  # the plan rule on the submitting host: the scheduler decides
    assert gpu_shortfall(spec, probe_job) is None
    assert gpu_shortfall(spec, H100) is not None  # a local probe saw the whole machine: 1 GPU for 2 ranks
