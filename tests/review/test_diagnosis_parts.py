"""The diagnosis parts are what producers build and what result.json holds: a part written with to_json reads back
equal, an earlier version's record writes back with exactly its keys, and event kinds are their strings."""

from __future__ import annotations

import json

from tunegrid.diagnosis import (
    CollectiveDiagnosis,
    Diagnosis,
    NanDiagnosis,
    NonfiniteKind,
    OomDiagnosis,
    RankCrash,
    TimeoutDiagnosis,
)


def test_a_part_built_by_a_producer_reads_back_equal_and_writes_its_keys_in_order():
    oom = OomDiagnosis(stage="step", bytes_at_failure=1, peak_bytes=2)
    assert list(oom.to_json()) == ["stage", "bytes_at_failure", "peak_bytes"]  # no reserved peak off CUDA
    assert OomDiagnosis(stage="load").to_json() == {"stage": "load"}  # no meter yet: the stage alone
    crash = RankCrash(ranks=[1], exit="SIGKILL", last_step=None, last_log_lines="", last_step_per_rank={})
    timeout = TimeoutDiagnosis(stage="step", limit_s=60, heartbeat_timeout_s=30, liveness=None)
    diagnosis = Diagnosis(oom=oom, rank_crash=crash, timeout=timeout)
    written = json.loads(json.dumps(diagnosis.to_json()))
    assert written["rank_crash"]["last_step"] is None and written["timeout"]["liveness"] is None
    assert Diagnosis.from_json(written) == diagnosis


def test_an_event_without_its_origin_has_no_micro_batch_and_its_kind_is_its_string():
    event = NanDiagnosis(step=3, kind=NonfiniteKind.SCALER_SKIP, loss=1.0, grad_norm="inf", loss_scale=2.0)
    assert event.to_json() == {"step": 3, "kind": "scaler_skip", "loss": 1.0, "grad_norm": "inf", "loss_scale": 2.0}
    traced = NanDiagnosis.from_json({**event.to_json(), "origin": {"forward": None}, "micro_batch": None})
    assert traced.micro_batch is None and "micro_batch" in traced.to_json() and traced.kind is NonfiniteKind.SCALER_SKIP
    assert json.dumps(NonfiniteKind.LOSS) == '"loss_nonfinite"'


def test_an_earlier_versions_record_writes_back_as_it_was_read():
    old = {"op": "ALLREDUCE", "missing_ranks": [1], "timeout_s": 5, "step": 3, "last_step_per_rank": {}, "verdict": "x"}
    collective = CollectiveDiagnosis.from_json(old)
    assert collective.to_json() == old and collective.kind is None and collective.waiting_ranks == []
    evidence = {"before_the_stall": {"rank": 1}, "parted_ranks": [1], "parted_at_step": 2}
    assert CollectiveDiagnosis.from_json({**old, "evidence": evidence}).parted_ranks == [1]
