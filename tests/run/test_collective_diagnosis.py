"""Collective timeouts told apart (straggler, long_pause, mismatch) from the files ranks leave: per-rank local
times in metrics.jsonl, heartbeats and the collective each waiting rank gave up in (on NCCL, the watchdog's line
in the rank's log). Fake rank folders check each rule on known evidence; two real gloo cells check what the
trainer writes (a mismatch from a rank that leaves the loop, and a straggler that does not time out reported as an
early warning)."""

from __future__ import annotations

import json
import pickle
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import one_cell, one_cell_spec, processes_mentioning, run_supervised

from tunegrid.cell_spec import CellSpec, StackRef
from tunegrid.run.collective import find_straggler
from tunegrid.run.rank_diagnosis import diagnose_ranks
from tunegrid.runtime.files import write_json
from tunegrid.runtime.rundir import rank_dir

TIMEOUT_S = 5
ALL_REDUCE = "step {} forward+backward (DDP all-reduce of gradients)"


def _spec(**distributed) -> CellSpec:
    spec = one_cell_spec()
    settings = {"collective_timeout_s": TIMEOUT_S, "straggler_factor": 1.5, "straggler_min_lag_s": 0.1, **distributed}
    return replace(spec, distributed=replace(spec.distributed, **settings))


def _rank(
    run_dir: Path,
    rank: int,
    times: list[float],
    beat: str,
    waiting_in: str | None = None,
    outcome: str | None = "timeout",
) -> None:
    """One rank's folder: metrics.jsonl with its local time per step, its heartbeat, and worker.json (a
    collective timeout where `waiting_in` is given; none for outcome None: a rank the supervisor stopped)."""
    folder = rank_dir(run_dir, rank)
    folder.mkdir(parents=True, exist_ok=True)
    lines = [{"step": s, "loss": 1.0, "step_time_s": 0.5, "local_time_s": t} for s, t in enumerate(times)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (folder / "heartbeat").write_text(beat)
    if outcome is None:
        return
    facts = {"outcome": outcome, "reason": "", "diagnosis": {}}
    if waiting_in is not None:
        facts["diagnosis"] = {
            "collective_timeout": {"rank": rank, "waiting_in": waiting_in, "timeout_s": TIMEOUT_S, "message": "x"}
        }
    write_json(folder / "worker.json", facts)


def _diagnose(run_dir: Path, codes=(0, -9), stopped=(1,)):
    result = {"outcome": "timeout"}
    return diagnose_ranks(_spec(), run_dir, result, list(codes), list(stopped))


def test_a_rank_slower_on_every_step_before_the_stall_is_a_straggler(tmp_path):
    _rank(tmp_path, 0, [0.3, 0.10, 0.11, 0.10], ALL_REDUCE.format(4), waiting_in=ALL_REDUCE.format(4))
    _rank(tmp_path, 1, [0.3, 0.40, 0.62, 0.81], ALL_REDUCE.format(4), outcome=None)
    update = _diagnose(tmp_path)
    collective = update["diagnosis"]["collective"]
    assert update["outcome"] == "timeout" and collective["kind"] == "straggler"
    straggler = collective["evidence"]["before_the_stall"]
    assert straggler["rank"] == 1 and straggler["slow_steps"] == 3 and straggler["steps_compared"] == 3
    assert straggler["median_ratio"] >= 5
    assert "straggler: rank 1" in update["reason"]


def test_ranks_in_step_until_one_stops_once_is_a_long_pause(tmp_path):
    _rank(tmp_path, 0, [0.3, 0.10, 0.11, 0.10], ALL_REDUCE.format(4), waiting_in=ALL_REDUCE.format(4))
    _rank(tmp_path, 1, [0.3, 0.11, 0.10, 0.12], "step 4 saving an evaluation", outcome=None)
    update = _diagnose(tmp_path)
    evidence = update["diagnosis"]["collective"]["evidence"]
    assert evidence["kind"] == "long_pause" and evidence["rank"] == 1 and evidence["step"] == 4
    assert evidence["phase"] == "step 4 saving an evaluation"
    assert 0.8 < evidence["pace_before"]["median_ratio"] < 1.25
    assert "long_pause: rank 1 stopped at step 4" in update["reason"]


def test_a_slow_first_step_alone_is_no_straggler(tmp_path):
    """Step 0 (warm-up) is left out, and one slow step is a pause, not a pattern."""
    _rank(tmp_path, 0, [0.1, 0.10, 0.10, 0.10], ALL_REDUCE.format(4), waiting_in=ALL_REDUCE.format(4))
    _rank(tmp_path, 1, [2.0, 0.10, 0.90, 0.10], ALL_REDUCE.format(4), outcome=None)
    assert _diagnose(tmp_path)["diagnosis"]["collective"]["kind"] == "long_pause"


def test_ranks_waiting_in_different_collectives_are_a_mismatch_with_where_they_parted(tmp_path):
    barrier = "end of training after step 2 (barrier: every rank finished its steps)"
    _rank(tmp_path, 0, [0.3, 0.10, 0.10], ALL_REDUCE.format(3), waiting_in=ALL_REDUCE.format(3))
    _rank(tmp_path, 1, [0.3, 0.10, 0.10], barrier, waiting_in=barrier)
    update = _diagnose(tmp_path, codes=(0, 0), stopped=())
    evidence = update["diagnosis"]["collective"]["evidence"]
    assert evidence["kind"] == "mismatch" and evidence["parted_ranks"] == [1] and evidence["parted_at_step"] == 3
    assert evidence["positions"] == {
        0: {"step": 3, "collective": "all-reduce"},
        1: {"step": 2, "collective": "barrier"},
    }
    assert "mismatch: rank(s) 1 took another path at step 3" in update["reason"]


def test_a_straggler_overrides_nothing_when_the_ranks_are_in_different_collectives(tmp_path):
    """A slow rank that also left the loop: the paths parting is the cause to fix first."""
    barrier = "end of training after step 3 (barrier: every rank finished its steps)"
    _rank(tmp_path, 0, [0.3, 0.10, 0.10, 0.10], ALL_REDUCE.format(4), waiting_in=ALL_REDUCE.format(4))
    _rank(tmp_path, 1, [0.3, 0.50, 0.50, 0.50], barrier, waiting_in=barrier)
    assert _diagnose(tmp_path, codes=(0, 0), stopped=())["diagnosis"]["collective"]["kind"] == "mismatch"


def _reading(status: str, mismatch: str | None = None, missing=(1,), **more):
    from tunegrid.diagnosis import RecorderReading

    first = {"group": "0", "group_desc": "0:default_pg", "collective": "nccl:all_reduce", "seq": 12}
    return RecorderReading.from_json(
        {"status": status, "first": {**first, "missing_ranks": list(missing), "mismatch": mismatch}, **more}
    )


def test_flight_recorder_mismatch_decides_on_gpu_only_from_a_complete_reading():
    from tunegrid.run.collective import classify_timeout

    ranks = [
        {"rank": 0, "local_times": {1: 0.1, 2: 0.1}, "last_heartbeat": ALL_REDUCE.format(3), "diagnosis": {}},
        {"rank": 1, "local_times": {1: 0.1, 2: 0.1}, "last_heartbeat": "step 3", "diagnosis": {}},
    ]
    kind = classify_timeout(ranks, [1], 3, 600, 1.5, _reading("found", "COLLECTIVE_TYPE_MISMATCH"))
    assert kind["kind"] == "mismatch" and kind["evidence"] == "flight_recorder"
    assert (kind["group"], kind["collective"], kind["seq"], kind["culprit_ranks"]) == (
        "0:default_pg",
        "nccl:all_reduce",
        12,
        [1],
    )
    assert kind["mismatch_type"] == "COLLECTIVE_TYPE_MISMATCH"
    assert classify_timeout(ranks, [1], 3, 600, 1.5, _reading("found"))["kind"] == "long_pause"  # ranks missing only
    for status in ("incomplete", "too_many_mismatches", "failed", "no_dumps"):
        assert classify_timeout(ranks, [1], 3, 600, 1.5, _reading(status, "COLLECTIVE_TYPE_MISMATCH"))["kind"] == (
            "long_pause"
        ), status


def test_straggler_not_slow_enough_to_time_out_is_still_reported(tmp_path):
    """An ok cell: a rank 3x slower on most steps is an early warning in result.json."""
    _rank(tmp_path, 0, [0.3, 0.10, 0.10, 0.11, 0.10], "adapter", outcome="ok")
    _rank(tmp_path, 1, [0.3, 0.30, 0.32, 0.10, 0.31], "end of training after step 4", outcome="ok")
    for rank in (0, 1):
        facts = json.loads((rank_dir(tmp_path, rank) / "worker.json").read_text())
        write_json(rank_dir(tmp_path, rank) / "worker.json", {**facts, "lora_sha256": "same"})
    update = diagnose_ranks(_spec(), tmp_path, {"outcome": "ok"}, [0, 0], [])
    assert "outcome" not in update  # still ok
    warning = update["distributed"]["straggler"]
    assert warning["rank"] == 1 and warning["slow_steps"] == 3 and warning["steps_compared"] == 4


def test_find_straggler_needs_most_steps_and_a_stated_factor():
    even = {0: {1: 1.0, 2: 1.0, 3: 1.0}, 1: {1: 1.4, 2: 1.4, 3: 1.4}}
    assert find_straggler(even, 1.5) is None  # 1.4x is under the factor
    assert find_straggler(even, 1.3)["rank"] == 1
    once = {0: {1: 1.0, 2: 1.0, 3: 1.0}, 1: {1: 9.0, 2: 1.0, 3: 1.0}}
    assert find_straggler(once, 1.5) is None  # one slow step of three is not most
    assert find_straggler({0: {1: 1.0}, 1: {1: 5.0}}, 1.5) is None  # one step compared says nothing
    noise = {0: {1: 0.006, 2: 0.005, 3: 0.006}, 1: {1: 0.02, 2: 0.03, 3: 0.02}}
    assert find_straggler(noise, 1.5, min_lag_s=0.1) is None  # 4x, but milliseconds: timer noise
    assert find_straggler(noise, 1.5)["rank"] == 1
    four = {r: {s: 1.0 for s in range(1, 5)} for r in range(4)}
    four[2] = {s: 2.0 for s in range(1, 5)}
    assert find_straggler(four, 1.5)["rank"] == 2  # against the other ranks' median


def _real(tmp_path, checkpoints, dataset_path, fault, debug, timeout_s=600, steps=4):
    spec = one_cell(
        model="qwen3moe-tiny",
        world=2,
        train={"steps": steps, "threads": 1},
        axes={"fault": fault, "collective_timeout_s": timeout_s},
        debug=debug,
        distributed={"exit_grace_s": 2},
    )
    run_dir = tmp_path / "runs" / spec["cell_id"]
    return run_supervised(spec, checkpoints, dataset_path, run_dir), run_dir


@pytest.mark.slow
def test_rank_leaving_the_loop_early_is_a_mismatch_naming_rank_and_step(checkpoints, dataset_path, tmp_path):
    result, run_dir = _real(
        tmp_path, checkpoints, dataset_path, "skip-collective", {"skip_collective": {"rank": 1, "step": 2}}, 4
    )
    assert result["cell_id"].endswith("_ws2_ct4_fault-skip-collective")
    assert result["outcome"] == "timeout", result["reason"]
    evidence = result["diagnosis"]["collective"]["evidence"]
    assert evidence["kind"] == "mismatch", result["reason"]
    assert evidence["parted_ranks"] == [1] and evidence["parted_at_step"] == 2
    assert evidence["positions"][1]["collective"] == "barrier"
    collective = result["diagnosis"]["collective"]
    assert collective["op"] == "ALLREDUCE" and collective["step"] == 2 and collective["missing_ranks"] == [1]
    # named while the ranks waited (a 1 s window at a 4 s timeout), and the timeout's verdict agreed
    early = collective["early"]
    assert early["kind"] == "mismatch" and early["same_kind"] and early["same_missing_ranks"], early
    assert early["quiet_for_s"] < 4
    assert processes_mentioning(run_dir) == []


@pytest.mark.slow
def test_slow_rank_that_does_not_time_out_ends_ok_with_a_straggler_warning(checkpoints, dataset_path, tmp_path):
    result, run_dir = _real(
        tmp_path, checkpoints, dataset_path, "slow-rank", {"slow_rank": {"rank": 1, "seconds": 0.6}}, steps=5
    )
    assert result["outcome"] == "ok", result["reason"]
    warning = result["distributed"]["straggler"]
    assert warning["rank"] == 1 and warning["slow_steps"] * 2 > warning["steps_compared"]
    metrics = [json.loads(line) for line in (run_dir / "ranks" / "rank1" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["local_time_s"] >= 0.6 for m in metrics)  # the injected delay is inside the local time


@pytest.mark.slow
def test_a_slow_rank_0_slows_the_cells_tokens_per_s_with_each_ranks_figure_beside_it(
    checkpoints, dataset_path, tmp_path
):
    """Rank 0 writes the cell's metrics: its delay is inside its step's wall time, and the cell's tokens/s is both
    ranks' real tokens over the slowest rank's step time (it read faster than its fault-free twin before)."""
    result, run_dir = _real(
        tmp_path, checkpoints, dataset_path, "slow-rank", {"slow_rank": {"rank": 0, "seconds": 0.6}}, steps=4
    )
    assert result["outcome"] == "ok", result["reason"]
    mine = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(m["step_time_s"] >= 0.6 for m in mine)
    throughput = result["throughput"]
    assert throughput["step_time_s_median"] >= 0.6 and set(throughput["per_rank"]) == {"0", "1"}
    tokens = [round(m["tokens_per_s"] * m["step_time_s"]) for m in mine[1:]]  # rank 0's real tokens, steps 1..
    assert throughput["tokens_per_s_median"] <= 2.5 * max(tokens) / 0.6  # both ranks' tokens over >= 0.6 s
    assert throughput["tokens_per_s_median"] > throughput["per_rank"]["0"]["tokens_per_s_median"]  # two ranks' work


def test_cell_throughput_is_all_tokens_over_the_slowest_ranks_step_time():
    from tunegrid.run.rank_diagnosis import cell_throughput

    per_rank = {0: {0: (100, 9.0), 1: (100, 2.0), 2: (100, 2.0)}, 1: {0: (120, 9.0), 1: (120, 1.0), 2: (120, 3.0)}}
    done = cell_throughput(per_rank)
    assert done["tokens_per_s_median"] == pytest.approx((220 / 2.0 + 220 / 3.0) / 2)  # step 0 left out
    assert done["step_time_s_median"] == 2.5
    assert done["per_rank"]["0"] == {"tokens_per_s_median": 50.0, "step_time_s_median": 2.0}
    assert done["per_rank"]["1"]["tokens_per_s_median"] == pytest.approx((120 + 40) / 2)
    assert cell_throughput({0: {1: (5, 1.0)}, 1: {}})["tokens_per_s_median"] is None  # no step every rank timed


def test_the_diagnosis_and_a_straggler_reach_the_run_tags_and_the_summary():
    from tunegrid.review.summary import summary_row
    from tunegrid.track.tags import run_tags

    evidence = {"kind": "straggler", "rank": 1, "before_the_stall": {"rank": 1, "median_ratio": 145.0}}
    collective = {"op": "ALLREDUCE", "missing_ranks": [1], "timeout_s": 5, "step": 3, "last_step_per_rank": {}}
    timed_out = {
        "cell_id": "q_fp32_bs2_none_s0_ws2_ct5_fault-slow-rank",
        "cell": {"axes": {"model": "q", "precision": "fp32", "batch_size": 2, "quant": "none", "seed": 0}},
        "outcome": "timeout",
        "reason": "collective timeout",
        "env": {},
        "diagnosis": {"collective": {**collective, "kind": "straggler", "evidence": evidence}},
    }
    tags = run_tags(timed_out)
    assert tags["collective.diagnosis"] == "straggler" and tags["straggler.rank"] == "1"
    row = summary_row(timed_out)
    assert row["collective_diagnosis"] == "straggler" and row["straggler_ratio"] == 145.0
    warned = {
        **timed_out,
        "outcome": "ok",
        "diagnosis": {},
        "distributed": {"straggler": {"rank": 1, "median_ratio": 3.1}},
    }
    assert run_tags(warned)["straggler.ratio"] == "3.1" and summary_row(warned)["straggler_rank"] == 1


def test_a_fault_axis_value_needs_its_debug_setting():
    import pytest

    from tunegrid.study.errors import ConfigError

    with pytest.raises(ConfigError, match=r"grid.fault': 'slow-rank' injects debug.slow_rank, which sets no rank"):
        one_cell(model="qwen3moe-tiny", world=2, axes={"fault": "slow-rank"})
    spec = one_cell(
        model="qwen3moe-tiny",
        world=2,
        axes={"fault": "none"},
        debug={"stall_rank": {"rank": 1, "step": 2, "seconds": 9}, "slow_rank": {"rank": 1, "seconds": 1}},
    )
    assert spec["debug"]["stall_rank"]["rank"] == -1 and spec["debug"]["slow_rank"]["rank"] == -1
    assert spec["cell_id"].endswith("_ws2_fault-none")


# What ProcessGroupNCCL's watchdog writes to a waiting rank's stderr before it aborts the process (SIGABRT):
# the lines as torch 2.x logs them for an all-reduce that one rank never joined.
NCCL_WATCHDOG_LOG = """\
[rank0]:[E1124 22:10:01.000000000 ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught collective operation timeout: \
WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=9216, NumelOut=9216, Timeout(ms)=4000) ran for 4012 milliseconds \
before timing out.
[rank0]:[E1124 22:10:01.000000000 ProcessGroupNCCL.cpp:630] [Rank 0] Some NCCL operations have failed or timed out. \
Due to the asynchronous nature of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data.
[rank0]:[E1124 22:10:01.000000000 ProcessGroupNCCL.cpp:636] [Rank 0] To avoid data inconsistency, we are taking \
the entire process down.
terminate called after throwing an instance of 'c10::DistBackendError'
"""


def _fake_ranks(run_dir, heartbeats, logs):
    """Rank folders as a cell's ranks leave them (heartbeat, rank log), without worker.json: a rank the NCCL
    watchdog aborted never writes one."""
    for rank, (beat, log) in enumerate(zip(heartbeats, logs, strict=True)):
        folder = run_dir if rank == 0 else run_dir / "ranks" / f"rank{rank}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "heartbeat").write_text(beat)
        (run_dir / "ranks").mkdir(exist_ok=True)
        (run_dir / "ranks" / f"rank{rank}.log").write_text(log)


def test_nccl_watchdog_abort_is_a_collective_timeout_not_a_retried_crash(tmp_path):
    from tunegrid.outcome import infrastructure_fault

    spec = _spec(collective_timeout_s=4)
    run_dir = tmp_path / "run"
    _fake_ranks(
        run_dir,
        ["step 2 forward+backward (DDP all-reduce of gradients)", "step 2 stalled (injected, 120 s)"],
        [NCCL_WATCHDOG_LOG, ""],
    )
    # rank 0 died by SIGABRT in the watchdog; rank 1 (the straggler) was stopped by the supervisor
    base = {"outcome": "error", "reason": "worker killed by SIGABRT", "worker_exit_code": -6}
    result = {**base, **diagnose_ranks(spec, run_dir, base, [-6, -15], [1])}
    assert result["outcome"] == "timeout", result["reason"]
    collective = result["diagnosis"]["collective"]
    assert collective["op"] == "ALLREDUCE" and collective["seq"] == 7 and collective["step"] == 2
    assert collective["waiting_ranks"] == [0] and collective["missing_ranks"] == [1]
    assert "rank(s) 1 did not arrive" in result["reason"]
    assert not infrastructure_fault(result)  # the settings time out again: never retried


def test_a_rank_killed_without_the_watchdog_line_is_still_a_crash(tmp_path):
    spec = _spec()
    run_dir = tmp_path / "run"
    _fake_ranks(run_dir, ["step 1 forward+backward", "step 1 forward+backward"], ["Segmentation fault\n", ""])
    base = {"outcome": "error", "reason": "worker killed by SIGABRT", "worker_exit_code": -6}
    update = diagnose_ranks(spec, run_dir, base, [-6, -15], [1])
    assert update["outcome"] == "error" and update["diagnosis"]["rank_crash"]["ranks"] == [0]


RECORDER_DATA = Path(__file__).resolve().parents[1] / "data" / "flight_recorder"


def _dumps(run_dir: Path, source: Path, name: str = "{}", drop=()) -> Path:
    """A cell's flight_recorder folder holding the dumps of `source`, renamed (`rank_{}`: as a cell's ranks name
    them), without the ranks in `drop`."""
    folder = run_dir / "flight_recorder"
    folder.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        rank = path.name.rsplit("_", 1)[-1]
        if path.name.startswith(("_dump_", "rank_")) and int(rank) not in drop:
            shutil.copy(path, folder / name.format(path.name if name == "{}" else rank))
    return folder


def test_every_rank_in_the_watchdog_the_recorder_names_who_did_not_arrive(tmp_path):
    """NVRx's gpu_error_1st: 16 ranks, every one logging the watchdog's line (each waited in some collective); the
    logs name nobody, the recorder names rank 12 in group 74's all_to_all #20537 (main: 'rank(s) none identified',
    'long_pause: rank None', only fr_trace's header line kept)."""
    run_dir = tmp_path / "run"
    beats = [ALL_REDUCE.format(7)] * 16
    _fake_ranks(run_dir, beats, [NCCL_WATCHDOG_LOG.replace("[Rank 0]", f"[Rank {r}]") for r in range(16)])
    _dumps(run_dir, RECORDER_DATA / "nvrx" / "gpu_error_1st")  # its own names: _dump_<rank>
    base = {"outcome": "error", "reason": "worker killed by SIGABRT", "worker_exit_code": -6}
    update = diagnose_ranks(_spec(collective_timeout_s=4), run_dir, base, [-6] * 16, [])
    collective = update["diagnosis"]["collective"]
    assert collective["missing_ranks"] == [12] and collective["missing_from"] == "flight_recorder"
    assert 12 not in collective["waiting_ranks"] and len(collective["waiting_ranks"]) == 15
    first = collective["flight_recorder"]["first"]
    assert (first["group_desc"], first["collective"], first["seq"]) == (
        "74:EXPERT_MODEL_PARALLEL_GROUP",
        "nccl:all_to_all",
        20537,
    )
    assert "rank(s) 12 did not arrive" in update["reason"] and "long_pause: rank 12 stopped" in update["reason"]
    assert (
        "flight recorder: nccl:all_to_all #20537 in group 74:EXPERT_MODEL_PARALLEL_GROUP, missing rank(s) 12"
        in (update["reason"])
    )
    assert update["distributed"]["flight_recorder"]["status"] == "found"


def test_a_straggler_without_a_dump_stays_a_straggler_never_a_mismatch(tmp_path):
    """NVRx's lock_gil_2nd without the dumps of ranks 10 and 15 (the ranks that stopped answering), rank 15 13.5x
    the others' local time before the stall: PyTorch's reader aborts ('Too many mismatches') on what it cannot
    pair; main read that as a mismatch ('no setting fixes it')."""
    for rank in range(16):
        slow = rank == 15
        times = [0.3, 1.35, 1.35, 1.35] if slow else [0.3, 0.10, 0.10, 0.10]
        if rank in (10, 15):
            _rank(tmp_path, rank, times, "step 4 forward", outcome=None)
        else:
            _rank(tmp_path, rank, times, ALL_REDUCE.format(4), waiting_in=ALL_REDUCE.format(4))
    _dumps(tmp_path, RECORDER_DATA / "nvrx" / "lock_gil_2nd", "rank_{}", drop=(10, 15))
    codes = [-15 if r in (10, 15) else 0 for r in range(16)]
    update = diagnose_ranks(_spec(), tmp_path, {"outcome": "timeout"}, codes, [10, 15])
    collective = update["diagnosis"]["collective"]
    assert collective["kind"] == "straggler" and collective["evidence"]["rank"] == 15, update["reason"]
    assert collective["evidence"]["before_the_stall"]["median_ratio"] == 13.5
    assert collective["flight_recorder"]["status"] == "incomplete"
    assert collective["flight_recorder"]["ranks_without_dumps"] == [10, 15]
    assert "flight recorder incomplete: no readable dump from rank(s) 10, 15, no verdict" in update["reason"]


@pytest.mark.parametrize(
    ("make", "status", "said"),
    [
        ("mixed_versions", "failed", "flight recorder failed: AssertionError: Rank 1 has different version"),
        ("empty_folder", "no_dumps", ""),
        ("reader_prints_nothing", "failed", "flight recorder failed: the reader gave no output (exit 0)"),
        ("gloo", "found", "flight recorder: gloo:all_reduce #4 in group 0:default_pg, missing rank(s) 1"),
    ],
)
def test_a_reading_that_failed_is_marked_never_stored_as_a_verdict(tmp_path, make, status, said):
    """main stored fr_trace's own crash as the verdict (on gloo's dumps of torch 2.13: "KeyError: ('0', 0)") and
    left an empty output unmarked; each is now a status, with what it found or why it could not."""
    _rank(tmp_path, 0, [0.3, 0.10, 0.10, 0.10], ALL_REDUCE.format(4), waiting_in=ALL_REDUCE.format(4))
    _rank(tmp_path, 1, [0.3, 0.10, 0.10, 0.10], "step 4 forward", outcome=None)
    spec = _spec()
    folder = _dumps(tmp_path, RECORDER_DATA / "gloo", "rank_{}")
    if make == "mixed_versions":
        dump = pickle.loads((folder / "rank_1").read_bytes())
        (folder / "rank_1").write_bytes(pickle.dumps({**dump, "version": "2.4"}))
    elif make == "empty_folder":
        for path in folder.iterdir():
            path.unlink()
    elif make == "reader_prints_nothing":
        silent = StackRef(name="silent", pins={}, key="silent", folder="", python=shutil.which("true"))
        spec = replace(spec, stack=silent)  # a stack whose interpreter reads no dump and prints nothing
    update = (
        _diagnose(tmp_path) if make == "gloo" else diagnose_ranks(spec, tmp_path, {"outcome": "timeout"}, [0, -9], [1])
    )
    collective = update["diagnosis"]["collective"]
    assert collective["flight_recorder"]["status"] == status and collective["kind"] == "long_pause"
    assert said in update["reason"] if said else "flight recorder" not in update["reason"], update["reason"]
    assert "flight_recorder_verdict" not in collective
    assert ("flight_recorder" in update["distributed"]) == (status != "no_dumps")  # a gloo cell's empty folder: quiet
