"""A hang named before the collective timeout (tunegrid.run.hang_watch): fake rank folders check what is named from
the heartbeats and local times there are while the ranks still run; real gloo cells at PyTorch's 600 s timeout
with `distributed.end_on_hang` end within seconds of their hang with the class the same fault gets at a short
timeout."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import one_cell, processes_mentioning, run_supervised

from tunegrid.cell_spec import CellSpec
from tunegrid.review.summary import summary_row
from tunegrid.run.hang_watch import HangWatch, hang_window_s
from tunegrid.runtime.rundir import rank_dir

ALL_REDUCE = "step {} forward+backward (DDP all-reduce of gradients): model.layers.0 backward"
# the distributed section at the schema's defaults: a 600 s collective timeout, stragglers past 1.5x and 0.1 s
SETTINGS = CellSpec.from_json(one_cell()).distributed


def _rank(run_dir: Path, rank: int, times: list[float], beat: str, beat_age_s: float) -> None:
    """A running rank's folder: its local time per step so far and its heartbeat, last written `beat_age_s` ago."""
    folder = rank_dir(run_dir, rank)
    folder.mkdir(parents=True, exist_ok=True)
    lines = [{"step": s, "loss": 1.0, "step_time_s": 0.5, "local_time_s": t} for s, t in enumerate(times)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (folder / "heartbeat").write_text(beat)
    then = time.time() - beat_age_s
    for name in ("metrics.jsonl", "heartbeat"):
        os.utime(folder / name, (then, then))


def _watch(run_dir: Path) -> HangWatch:
    watch = HangWatch(run_dir, 2, SETTINGS, predicted_step_s=0.05)
    watch.started -= 300  # the ranks started five minutes ago
    return watch


def test_the_window_is_a_tenth_of_the_timeout_within_a_minute_and_never_under_three_steps():
    assert hang_window_s(SETTINGS, None) == 60  # PyTorch's 600 s: named within a minute
    assert hang_window_s(replace(SETTINGS, collective_timeout_s=1800), None) == 60  # Hugging Face's 1,800 s
    assert hang_window_s(replace(SETTINGS, collective_timeout_s=5), None) == 1
    assert hang_window_s(replace(SETTINGS, collective_timeout_s=120), 30.0) == 90  # three predicted steps
    assert hang_window_s(replace(SETTINGS, hang_window_s=4), 30.0) == 4  # the study's own


def test_a_rank_that_stopped_while_its_peer_waits_is_named_a_long_pause(tmp_path):
    _rank(tmp_path, 0, [0.1, 0.1, 0.1], ALL_REDUCE.format(3), beat_age_s=70)
    _rank(tmp_path, 1, [0.1, 0.1, 0.1], "step 3 stalled (injected, 900 s)", beat_age_s=71)
    watch = _watch(tmp_path)
    named = watch.check([None, None])
    assert named is not None and named.kind == "long_pause", named
    assert named.missing_ranks == [1] and named.waiting_ranks == [0] and named.step == 3
    assert named.collective == "ALLREDUCE" and named.quiet_for_s >= 60
    assert "rank(s) 1 did not arrive" in named.reason(600) and "before the 600 s timeout" in named.reason(600)
    assert watch.check([None, None]) is None  # named once


def test_ranks_in_different_collectives_are_named_a_mismatch(tmp_path):
    _rank(tmp_path, 0, [0.1, 0.1, 0.1], ALL_REDUCE.format(3), beat_age_s=65)
    _rank(tmp_path, 1, [0.1, 0.1, 0.1], "end of training after step 2 (barrier: every rank finished)", beat_age_s=66)
    named = _watch(tmp_path).check([None, None])
    assert named.kind == "mismatch" and named.missing_ranks == [1] and named.step == 3, named


def test_the_rank_slower_on_every_step_is_named_a_straggler(tmp_path):
    # both heartbeats name step 3's all-reduce; the straggler's is the older one (its peer pulsed through its
    # backward since) and its local time was 3x on every step before
    _rank(tmp_path, 0, [0.1, 0.1, 0.1], ALL_REDUCE.format(3), beat_age_s=61)
    _rank(tmp_path, 1, [0.3, 0.3, 0.3], ALL_REDUCE.format(3), beat_age_s=64)
    named = _watch(tmp_path).check([None, None])
    assert named.kind == "straggler" and named.missing_ranks == [1] and named.waiting_ranks == [0], named


def test_nothing_is_named_before_the_window_nor_once_a_rank_ended_nor_without_a_collective(tmp_path):
    _rank(tmp_path, 0, [0.1, 0.1], ALL_REDUCE.format(2), beat_age_s=20)
    _rank(tmp_path, 1, [0.1, 0.1], "step 2 stalled (injected, 900 s)", beat_age_s=21)
    assert _watch(tmp_path).check([None, None]) is None  # 20 s of quiet at a 60 s window
    _rank(tmp_path, 0, [0.1, 0.1], ALL_REDUCE.format(2), beat_age_s=90)
    _rank(tmp_path, 1, [0.1, 0.1], "step 2 stalled (injected, 900 s)", beat_age_s=91)
    assert _watch(tmp_path).check([None, -9]) is None  # a rank ended: the supervisor reads that
    _rank(tmp_path, 0, [0.1], "load", beat_age_s=90)
    _rank(tmp_path, 1, [0.1], "load", beat_age_s=90)
    assert _watch(tmp_path).check([None, None]) is None  # nobody waits in a collective


FAULTS = {
    "stall-rank": ({"stall_rank": {"rank": 1, "step": 2, "seconds": 900}}, "long_pause"),
    "skip-collective": ({"skip_collective": {"rank": 1, "step": 2}}, "mismatch"),
    # 1.5 s more at every step: longer than the window at step 3, with steps 1 and 2 to compare before
    "slow-rank": ({"slow_rank": {"rank": 1, "seconds": 0, "growth_s": 1.5}}, "straggler"),
}


@pytest.mark.slow
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_at_a_600_s_timeout_a_hung_cell_ends_within_seconds_with_the_class_a_short_timeout_gives(
    fault, checkpoints, dataset_path, tmp_path
):
    debug, kind = FAULTS[fault]
    spec = one_cell(
        model="qwen3moe-tiny",
        world=2,
        train={"steps": 5, "threads": 1},
        axes={"fault": fault, "collective_timeout_s": 600},
        debug=debug,
        distributed={"exit_grace_s": 2, "hang_window_s": 4, "end_on_hang": True},
    )
    run_dir = tmp_path / "runs" / spec["cell_id"]
    result = run_supervised(spec, checkpoints, dataset_path, run_dir, worker="spawned")
    assert result["outcome"] == "timeout", result["reason"]
    collective = result["diagnosis"]["collective"]
    assert collective["kind"] == kind and collective["missing_ranks"] == [1], result["reason"]
    assert collective["missing_from"] == "hang_watch" and "before the 600 s timeout" in result["reason"]
    early = collective["early"]
    assert 4 <= early["quiet_for_s"] < 60, early  # named within the minute, never before the window
    assert result["wall_s"] < 120, result["wall_s"]  # the 600 s timeout (or the 900 s stall) never waited out
    row = summary_row(result)  # time-to-verdict in the summary, beside the class
    assert row["collective_diagnosis"] == kind and row["collective_named_after_s"] == early["quiet_for_s"]
    assert processes_mentioning(run_dir) == []
