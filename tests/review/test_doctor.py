"""The doctor's decisions, from files alone: reproduced or not, deterministic or transient (a transient
injection spares the repeat), the second wave chosen from the tables and the estimate, its tries, and the fix
of the baseline read from the recommender's output."""

from __future__ import annotations

import pytest
from conftest import make_study

from tunegrid.review.doctor_choice import (
    DETERMINISTIC,
    NOT_REPRODUCED,
    TRANSIENT,
    choose,
    doctor_cells,
    memory_choice_cells,
    repeat_of,
    reproduction,
    tries,
)
from tunegrid.review.doctor_verdict import baseline_fixes
from tunegrid.study.config import baseline_cell, cell_spec, cells_by_id, resolve_study
from tunegrid.vocabulary import parse_cell_id

CAPABILITIES = {"precision": {"fp32": "native", "bf16": "native", "fp16": "emulated", "tf32": "absent"}}


def _nan(step=0, module="layers.0.mlp.down_proj"):
    return {
        "cell_id": "x",
        "outcome": "nan",
        "nan_step": step,
        "nan_kind": "loss_nonfinite",
        "nan_forward_module": module,
        "nan_backward_module": None,
    }


def test_a_baseline_that_runs_ok_is_not_reproduced_and_needs_no_repeat():
    assert reproduction({"outcome": "ok", "steps_run": 30, "reason": ""}, None)["verdict"] == NOT_REPRODUCED


def test_the_same_step_and_origin_twice_is_deterministic_anything_else_transient():
    assert reproduction(_nan(), _nan())["verdict"] == DETERMINISTIC
    assert reproduction(_nan(), _nan(step=3))["verdict"] == TRANSIENT
    assert reproduction(_nan(), _nan(module="layers.1.mlp.down_proj"))["verdict"] == TRANSIENT
    ran_ok = {"outcome": "ok", "steps_run": 30, "reason": ""}
    found = reproduction(_nan(), ran_ok)
    assert found["verdict"] == TRANSIENT and found["repeat"]["outcome"] == "ok"  # both runs' evidence kept


def test_an_oom_is_deterministic_at_the_same_stage_whichever_step_it_reached():
    oom = {"outcome": "oom", "oom_stage": "step", "steps_run": 1}
    assert reproduction(oom, {**oom, "steps_run": 2})["verdict"] == DETERMINISTIC
    assert reproduction(oom, {**oom, "oom_stage": "load"})["verdict"] == TRANSIENT


def _injecting(transient):
    inject = {"module": "model.layers.0.mlp.down_proj", "step": 1, "transient": transient}
    return resolve_study(make_study(debug={"inject_nonfinite": inject}))


@pytest.mark.parametrize("transient", [True, False])
def test_a_transient_injection_spares_the_repeat_only(transient):
    study = _injecting(transient)
    cell = next(iter(cells_by_id(study).values()))
    first, again = cell_spec(study, cell).to_json(), cell_spec(study, repeat_of(cell)).to_json()
    assert first["debug"]["inject_nonfinite"]["module"] == "model.layers.0.mlp.down_proj"
    assert bool(again["debug"]["inject_nonfinite"]["module"]) is not transient
    assert "transient" not in first["debug"]["inject_nonfinite"]  # spent when the spec is made
    assert again["axes"]["seed"] == first["axes"]["seed"]  # a repeat is the same cell, the same seed


def test_the_repeat_is_a_cell_of_its_own_id_beside_the_grid():
    study = resolve_study(make_study())
    cell = baseline_cell(study)
    repeat = repeat_of(cell)
    assert repeat.cell_id == f"{cell.cell_id}_rep1" and parse_cell_id(repeat.cell_id) == repeat.axes()
    assert repeat.cell_id in doctor_cells(study) and repeat.cell_id not in cells_by_id(study)
    with pytest.raises(ValueError, match="not a cell"):
        baseline_cell(study, "gemma3-hot_fp64_bs2_none_s0")


def _precision_study(target="native"):
    grid = {"model": ["gemma3-hot"], "precision": ["fp16", "fp16-islands", "bf16", "fp32"], "quant": ["none"]}
    return resolve_study(make_study(grid=grid, hardware={"target": target}))


def test_a_nonfinite_failure_gets_the_precisions_of_the_table_the_target_runs():
    study = _precision_study()
    baseline = baseline_cell(study)
    choice = choose(study, baseline, {**_nan(), "target": "native"}, CAPABILITIES)
    assert [c.change["precision"] for c in choice.candidates] == ["bf16", "fp16-islands", "fp32"]  # nan_fix_rank
    assert all(c.reference == "gemma3-hot_fp32_bs2_none_s0" for c in choice.candidates[:2])
    assert choice.candidates[2].reference is None  # fp32 is its own reference

    t4 = _precision_study("t4")
    choice = choose(t4, baseline_cell(t4), {**_nan(), "target": "t4"}, CAPABILITIES)
    assert "bf16" not in [c.change["precision"] for c in choice.candidates]  # a T4 has no bf16
    assert any(s.startswith("precision bf16") for s in choice.skipped)


def test_on_a_named_target_the_precisions_are_tried_cheapest_first_on_it():
    """On a T4 the twins' plans order the candidates by their modelled step time; on the machine itself the plans'
    order stands."""
    from tunegrid.review.doctor_choice import precision_choice_cells

    native = _precision_study()  # read there too, for the bound on each candidate's throughput
    assert len(precision_choice_cells(native, baseline_cell(native))) == 3
    l4 = _precision_study("l4")
    baseline = baseline_cell(l4)
    twins = precision_choice_cells(l4, baseline)
    assert sorted(twins) == sorted(f"gemma3-hot_{p}_bs2_none_s0" for p in ("fp16-islands", "bf16", "fp32"))
    steps = {"fp16-islands": 0.004, "bf16": 0.003, "fp32": 0.002}  # fp32 the cheapest here, for the test's sake
    plans = {f"gemma3-hot_{p}_bs2_none_s0": {"modelled_step_s": s} for p, s in steps.items()}
    native = {"precision": {"fp32": "native", "bf16": "native", "fp16": "native", "tf32": "native"}}
    choice = choose(l4, baseline, {**_nan(), "target": "l4"}, native, plans)
    assert [c.change["precision"] for c in choice.candidates] == ["fp32", "bf16", "fp16-islands"]
    assert choice.candidates[0].why.endswith("; 2 ms/step modelled on l4")


def _memory_study():
    grid = {
        "model": ["gemma3-hot"],
        "precision": ["fp32"],
        "quant": ["none"],
        "optimizer": ["adamw", "adamw-8bit"],
        "activation_checkpointing": [False, True],
    }
    return resolve_study(make_study(grid=grid))


def _runnable(baseline, estimates_mib: dict[str, int]) -> dict[str, dict]:
    """Plans that run, by the baseline's id suffix: {suffix: estimate in MiB}."""
    return {
        f"{baseline.cell_id}{suffix}": {"estimate_bytes": mib * 2**20, "verdict": "run"}
        for suffix, mib in estimates_mib.items()
    }


def test_the_chunked_loss_is_a_memory_candidate_ranked_by_its_predicted_saving():
    grid = {"model": ["gemma3-hot"], "precision": ["fp32"], "quant": ["none"], "loss": ["full", "chunked"]}
    grid["optimizer"] = ["adamw", "adamw-8bit"]
    study = resolve_study(make_study(grid=grid))
    baseline = baseline_cell(study)
    plans = _runnable(baseline, {"": 500, "_adamw-8bit": 450, "_loss-chunked": 300, "_adamw-8bit_loss-chunked": 250})
    choice = choose(study, baseline, {"outcome": "oom", "oom_stage": "step"}, CAPABILITIES, plans)
    assert [c.change for c in choice.candidates] == [
        {"loss": "chunked"},
        {"optimizer": "adamw-8bit"},
        {"optimizer": "adamw-8bit", "loss": "chunked"},
    ]
    assert f"{baseline.cell_id}_loss-chunked" in memory_choice_cells(study, baseline)


def test_an_oom_gets_the_memory_settings_the_estimate_allows_one_change_at_a_time_first():
    study = _memory_study()
    baseline = baseline_cell(study)
    mib = 2**20
    plans = _runnable(baseline, {"": 500, "_adamw-8bit": 450, "_ac": 380, "_adamw-8bit_ac": 330})
    oom = {"outcome": "oom", "oom_stage": "step"}
    choice = choose(study, baseline, oom, CAPABILITIES, plans)
    assert [c.change for c in choice.candidates] == [
        {"activation_checkpointing": True},  # one setting first, the larger predicted saving (120 MiB) first
        {"optimizer": "adamw-8bit"},
        {"optimizer": "adamw-8bit", "activation_checkpointing": True},
    ]
    # the plan's verdict where the study skips predicted failures, and a setting predicted to save nothing
    plans[f"{baseline.cell_id}_ac"] = {"verdict": "predicted_oom", "reason": "estimated peak exceeds the budget"}
    plans[f"{baseline.cell_id}_adamw-8bit"]["estimate_bytes"] = 520 * mib
    choice = choose(study, baseline, oom, CAPABILITIES, plans)
    assert [c.cell_id for c in choice.candidates] == [f"{baseline.cell_id}_adamw-8bit_ac"]
    assert set(choice.skipped) == {
        "optimizer=adamw-8bit: the estimate predicts no saving (20 MiB more)",
        "activation_checkpointing=True: predicted_oom (estimated peak exceeds the budget)",
    }


def test_a_smaller_micro_batch_is_one_setting_and_among_as_many_settings_the_cheapest_bound_comes_first():
    """Checkpointing saves more than a micro-batch of 1 with grad_accum 2, but recomputes the forward: its plan
    bounds it at fewer tokens/s, so the micro-batch is tried first (`--first` stops at the likelier first fix of the
    report, which ranks by throughput); a candidate without a bound comes after those with one. Checkpointing
    with the micro-batch is two settings: last."""
    grid = {"model": ["gemma3-hot"], "precision": ["fp32"], "quant": ["none"], "batch_size": [2, 1]}
    grid.update(grad_accum=[1, 2], activation_checkpointing=[False, True])
    grid["exclude"] = [{"batch_size": 2, "grad_accum": 2}, {"batch_size": 1, "grad_accum": 1}]
    study = resolve_study(make_study(grid=grid))
    baseline = baseline_cell(study)
    micro = baseline.cell_id.replace("_bs2_", "_bs1_") + "_ga2"
    plans = _runnable(baseline, {"": 500, "_ac": 300})
    plans[micro] = {"estimate_bytes": 400 * 2**20, "verdict": "run", "ceiling_tokens_per_s": 900.0}
    plans[f"{micro}_ac"] = {"estimate_bytes": 250 * 2**20, "verdict": "run", "ceiling_tokens_per_s": 600.0}
    oom = {"outcome": "oom", "oom_stage": "step"}
    order = [c.cell_id for c in choose(study, baseline, oom, CAPABILITIES, plans).candidates]
    assert order == [micro, f"{baseline.cell_id}_ac", f"{micro}_ac"]  # checkpointing, unbounded: after it
    plans[f"{baseline.cell_id}_ac"]["ceiling_tokens_per_s"] = 600.0
    order = [c.cell_id for c in choose(study, baseline, oom, CAPABILITIES, plans).candidates]
    assert order == [micro, f"{baseline.cell_id}_ac", f"{micro}_ac"]
    for plan in plans.values():  # no bounds at all: the larger predicted saving first, as before
        plan.pop("ceiling_tokens_per_s", None)
    order = [c.cell_id for c in choose(study, baseline, oom, CAPABILITIES, plans).candidates]
    assert order == [f"{baseline.cell_id}_ac", micro, f"{micro}_ac"]


def test_a_memory_setting_its_plan_charges_clearly_over_the_budget_is_ruled_out():
    """What a plan's estimate charges the budget (on a CPU, the estimate less the runtime mapped before the budget
    is set) at 1.2x the budget or more rules a candidate out; nearer the budget the estimate does not decide and it
    runs (the baseline's own failure is the measurement)."""
    from tunegrid.review.doctor_choice import CLEAR_MISS

    study = _memory_study()
    baseline = baseline_cell(study)
    mib, budget = 2**20, 600 * 2**20
    plans = _runnable(baseline, {"": 1900, "_adamw-8bit": 1830, "_ac": 725, "_adamw-8bit_ac": 660})
    charges = {"": 1500, "_adamw-8bit": 1430, "_ac": 330, "_adamw-8bit_ac": 270}
    for suffix, charge in charges.items():
        plans[f"{baseline.cell_id}{suffix}"].update(charge_bytes=charge * mib, budget_bytes=budget)
    choice = choose(study, baseline, {"outcome": "oom", "oom_stage": "step"}, CAPABILITIES, plans)
    assert [c.change for c in choice.candidates] == [
        {"activation_checkpointing": True},
        {"optimizer": "adamw-8bit", "activation_checkpointing": True},
    ]
    assert choice.skipped == [
        "optimizer=adamw-8bit: its plan charges 1430 MiB against the 600 MiB budget (2.38x, 1.2x or more: out of "
        "memory too)"
    ]
    plans[f"{baseline.cell_id}_adamw-8bit"]["charge_bytes"] = int(CLEAR_MISS * budget) - 1  # just under: it runs
    choice = choose(study, baseline, {"outcome": "oom", "oom_stage": "step"}, CAPABILITIES, plans)
    assert {"optimizer": "adamw-8bit"} in [c.change for c in choice.candidates] and not choice.skipped


def test_a_plans_charge_is_its_estimate_less_the_runtime_on_a_cpu_and_all_of_it_on_cuda():
    from tunegrid.contract import CellPlan

    estimate = {"worker": "spawned", "estimate_bytes": 1000, "stage": "step", "load_bytes": 500, "step_bytes": 1000}
    estimate["components"] = {"runtime": 400, "activations": 600}
    liveness = {"heartbeat_timeout_s": 1.0, "time_limit_s": 1.0, "predicted_step_s": None, "step_flops": 0.0}
    liveness |= {"rate_tflops": None, "margin": 4.0, "extra_steps": 0}
    raw = {"cell_id": "c", "world_size": 1, "target": "native", "budget_bytes": 600, "device": "cpu"}
    raw |= {"worker": "spawned", "estimates": {"spawned": estimate}, "kernels": {}, "liveness": liveness}
    plan = CellPlan.from_json({**raw, "mem_mb": 1})
    assert plan.charge_bytes() == 600 and plan.row()["charge_bytes"] == 600
    assert CellPlan.from_json({**raw, "mem_mb": 1, "device": "cuda"}).charge_bytes() == 1000


def test_a_collective_timeout_gets_its_class_fixes():
    grid = {
        "model": ["gemma3-hot"],
        "precision": ["fp32"],
        "quant": ["none"],
        "world_size": [2],
        "collective_timeout_s": [5, 7, 9],
        "fault": ["stall-rank", "none"],
    }
    study = resolve_study(make_study(grid=grid, debug={"stall_rank": {"rank": 1, "step": 2, "seconds": 6}}))
    baseline = baseline_cell(study)
    pause = choose(study, baseline, {"outcome": "timeout", "collective_diagnosis": "long_pause"}, CAPABILITIES)
    assert [c.change for c in pause.candidates] == [{"collective_timeout_s": 7}, {"collective_timeout_s": 9}]
    straggler = choose(study, baseline, {"outcome": "timeout", "collective_diagnosis": "straggler"}, CAPABILITIES)
    assert [c.change for c in straggler.candidates] == [{"fault": "none"}]
    mismatch = choose(study, baseline, {"outcome": "timeout", "collective_diagnosis": "mismatch"}, CAPABILITIES)
    assert not mismatch.candidates and mismatch.skipped


def test_tries_run_one_candidate_at_a_time_with_its_reference():
    choice = {
        "candidates": [
            {"cell_id": "a", "reference": "ref"},
            {"cell_id": "b", "reference": "ref"},
            {"cell_id": "ref", "reference": None},
        ]
    }
    assert tries(choice) == [["a", "ref"], ["b"], []]
    assert tries({"candidates": []}) == []


def test_the_fix_of_the_baseline_is_the_first_whose_own_twin_is_evidence():
    baseline = "gemma3-hot_fp16_bs2_none_s0"
    recs = [
        {"failing": ["other"], "concerns": [], "text": "", "title": "", "fixes": [{"change": {}, "evidence": []}]},
        {
            "failing": [baseline, f"{baseline}_rep1"],
            "concerns": [],
            "text": "t",
            "title": "nan",
            "fixes": [
                {"change": {"precision": "bf16"}, "evidence": ["gemma3-hot_bf16_bs8_none_s0"]},  # another batch's
                {"change": {"precision": "fp32"}, "evidence": ["gemma3-hot_fp32_bs2_none_s0"]},
            ],
        },
    ]
    found = baseline_fixes(baseline, recs)
    assert [f["cell_id"] for f in found] == ["gemma3-hot_fp32_bs2_none_s0"]


def _cell_files(root, cell_id, outcome, losses, skipped=None, diagnosis=None, step_times=None):
    """A cell's result.json and metrics.jsonl as a run leaves them (`skipped`: the running skipped_steps;
    `step_times`: each step's seconds, 64 tokens a step)."""
    import json
    import statistics

    run = root / cell_id
    run.mkdir(parents=True)
    result = {"cell_id": cell_id, "cell": {"axes": parse_cell_id(cell_id)}, "outcome": outcome, "reason": outcome}
    result["diagnosis"] = diagnosis or {}
    if step_times:
        median = statistics.median(step_times)
        result["throughput"] = {"tokens_per_s_median": 64 / median, "step_time_s_median": median}
    (run / "result.json").write_text(json.dumps(result))
    skipped = skipped or [0] * len(losses)
    lines = [{"step": i, "loss": loss, "skipped_steps": s} for i, (loss, s) in enumerate(zip(losses, skipped))]
    for line, seconds in zip(lines, step_times or [], strict=False):
        line.update(step_time_s=seconds, tokens_per_s=64 / seconds)
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return run / "result.json"


def test_the_doctors_fp16_candidate_is_judged_on_the_steps_that_trained(tmp_path):
    """The measured recipe: fp16 nan deterministic; its fp16-mixed candidate's GradScaler skipped its first 3
    steps (65536 -> 8192), and the cell made them up (4 updates in 7 steps run). Judged on its updates it holds
    beside fp32; judged step by step it 'deviated' (its step 3, before any update, against fp32's after three),
    and the only fix written back was fp32."""
    from tunegrid.review.doctor_verdict import verdict_of

    grid = {"model": ["gemma3-hot"], "precision": ["fp16", "fp16-mixed", "fp32"], "quant": ["none"]}
    study = resolve_study(make_study(grid=grid))
    nan = {"nan": {"step": 0, "kind": "loss_nonfinite", "origin": {"forward": {"module": "model.layers.7"}}}}
    results = [
        _cell_files(tmp_path, "gemma3-hot_fp16_bs2_none_s0", "nan", [float("nan")], [1], nan),
        _cell_files(
            tmp_path,
            "gemma3-hot_fp16-mixed_bs2_none_s0",
            "ok",
            [2.14, 2.20, 2.21, 2.21, 1.86, 1.56, 1.35],
            [1, 2, 3, 3, 3, 3, 3],
        ),
        _cell_files(tmp_path, "gemma3-hot_fp32_bs2_none_s0", "ok", [2.14, 1.85, 1.55, 1.34]),
    ]
    native = {"precision": {"fp32": "native", "bf16": "native", "fp16": "native"}}
    verdict = verdict_of(study, "gemma3-hot_fp16_bs2_none_s0", results, native)
    fixes = {fix["cell_id"] for fix in verdict.fixes}
    assert "gemma3-hot_fp16-mixed_bs2_none_s0" in fixes, verdict.recommendations


# The default mode's stopping rule: after a try whose fix holds, the second wave ends once no candidate left can
# rank above that fix in the report, by what each one's plan says before it runs.


def _left(change, cell_id, **bound):
    return {"change": change, "cell_id": cell_id, "reference": None, "ceiling_basis": "its floor", **bound}


def _fix(change, cell_id):
    return {"change": change, "cell_id": cell_id, "evidence": [cell_id]}


BF16, FP32, ISLANDS = "m_bf16_bs2_none_s0", "m_fp32_bs2_none_s0", "m_fp16-islands_bs2_none_s0"


def _native_choice(ceiling):
    from tunegrid.review.doctor_choice import BY_THROUGHPUT

    candidates = [
        _left({"precision": "bf16"}, BF16),
        _left({"precision": "fp16-islands"}, ISLANDS, ceiling_tokens_per_s=ceiling),
        _left({"precision": "fp32"}, FP32),
    ]
    return {"failure": "nan", "ranked_by": BY_THROUGHPUT, "candidates": candidates}


ROWS = {
    BF16: {"tokens_per_s": 1000.0, "step_time_noise": 0.05},
    FP32: {"tokens_per_s": 400.0, "step_time_noise": 0.01},
}
PROVEN = [_fix({"precision": "bf16"}, BF16), _fix({"precision": "fp32"}, FP32)]


@pytest.mark.parametrize(
    ("ceiling", "stops"),
    [
        (900.0, True),  # cannot reach the fastest fix's 1000 tokens/s less its 5 % noise: not needed
        (960.0, False),  # could tie with it within its noise, and rank first by nan_fix_rank: run it
        (1200.0, False),  # could be faster
        (None, False),  # no bound: run it
    ],
)
def test_on_the_machine_the_doctor_stops_when_no_candidate_left_can_reach_the_fastest_proven_fix(ceiling, stops):
    from tunegrid.review.doctor_stop import stop

    done, why = stop(_native_choice(ceiling), PROVEN, ROWS, [BF16, FP32], first=False)
    assert done is stops
    if stops:
        assert why == [
            "precision=fp16-islands: at most 900 tokens/s here (its floor), below the 1000 measured for "
            "precision=bf16 less its 5% noise"
        ]


def test_the_doctor_never_stops_before_a_fix_holds_and_first_stops_at_the_first_that_does():
    from tunegrid.review.doctor_stop import stop

    choice = _native_choice(5000.0)
    assert stop(choice, [], ROWS, [BF16, FP32], first=False) == (False, [])
    assert stop(choice, [], ROWS, [BF16, FP32], first=True) == (False, [])
    done, why = stop(choice, PROVEN, ROWS, [BF16, FP32], first=True)
    assert done and why == ["precision=fp16-islands: not run (--first)"]
    assert stop(choice, PROVEN, ROWS, [BF16, ISLANDS, FP32], first=False) == (True, [])  # none left


def test_a_memory_fix_is_bounded_by_the_fastest_proven_fix_without_a_noise_margin():
    from tunegrid.review.doctor_choice import BY_THROUGHPUT
    from tunegrid.review.doctor_stop import stop

    ac, other = "m_fp32_bs2_none_s0_ac", "m_fp32_bs2_none_s0_adamw-8bit_loss-chunked"
    choice = {
        "failure": "oom",
        "ranked_by": BY_THROUGHPUT,
        "candidates": [
            _left({"activation_checkpointing": True}, ac),
            _left({"optimizer": "adamw-8bit", "loss": "chunked"}, other, ceiling_tokens_per_s=980.0),
        ],
    }
    rows = {ac: {"tokens_per_s": 1000.0, "step_time_noise": 0.05}}
    fixes = [_fix({"activation_checkpointing": True}, ac)]
    assert stop(choice, fixes, rows, [ac], first=False)[0]  # the memory fixes rank by throughput alone
    choice["candidates"][1]["ceiling_tokens_per_s"] = 1001.0
    assert not stop(choice, fixes, rows, [ac], first=False)[0]


AC, AC_8BIT, CHUNKED_8BIT = "m_fp32_bs2_none_s0_ac", "m_fp32_bs2_none_s0_adamw-8bit_ac", "m_fp32_bs2_none_s0_8c"


def _memory_choice(*candidates):
    from tunegrid.review.doctor_choice import BY_THROUGHPUT

    return {"failure": "oom", "ranked_by": BY_THROUGHPUT, "candidates": list(candidates)}


def test_a_memory_candidate_that_adds_settings_to_a_proven_fix_is_not_run_whatever_its_bound():
    """Checkpointing alone holds: checkpointing with 8-bit AdamW changes one more setting for a failure already
    ended, and the report ranks it after checkpointing however fast it runs, so its unknown bound does not matter."""
    from tunegrid.review.doctor_stop import stop

    choice = _memory_choice(
        _left({"activation_checkpointing": True}, AC),
        _left({"activation_checkpointing": True, "optimizer": "adamw-8bit"}, AC_8BIT),  # no bound
    )
    rows = {AC: {"tokens_per_s": 6.0}}
    done, why = stop(choice, [_fix({"activation_checkpointing": True}, AC)], rows, [AC], first=False)
    assert done and why == [
        "activation_checkpointing=True, optimizer=adamw-8bit: adds optimizer=adamw-8bit to "
        f"activation_checkpointing=True ({AC}), which already holds: ranked after it"
    ]
    # nothing holds yet: every candidate runs in turn
    assert stop(choice, [], rows, [AC], first=False) == (False, [])


def test_a_try_passes_over_a_candidate_that_adds_to_a_proven_fix_while_others_still_run():
    """Another candidate left has no bound, so the wave goes on, but its tries skip the one that adds to the fix
    that holds; the verdict names it with the rest once the wave ends."""
    from tunegrid.review.doctor_stop import passed_over, stop

    choice = _memory_choice(
        _left({"activation_checkpointing": True}, AC),
        _left({"activation_checkpointing": True, "optimizer": "adamw-8bit"}, AC_8BIT),
        _left({"loss": "chunked", "optimizer": "adamw-8bit"}, CHUNKED_8BIT),  # no bound
    )
    fixes, rows = [_fix({"activation_checkpointing": True}, AC)], {AC: {"tokens_per_s": 6.0}}
    assert stop(choice, fixes, rows, [AC], first=False) == (False, [])
    passed = passed_over(choice, fixes, [AC])
    assert list(passed) == [AC_8BIT]
    assert tries(choice, passed) == [[AC], [], [CHUNKED_8BIT]]
    done, why = stop(choice, fixes, rows, [AC, CHUNKED_8BIT], first=False)
    assert done and why == [passed[AC_8BIT]]
    # a non-finite failure's candidates are never passed over (each changes the precision alone)
    assert passed_over({**choice, "failure": "nan"}, fixes, [AC]) == {}


def test_on_a_named_target_the_doctor_stops_when_every_candidate_left_is_modelled_slower():
    from tunegrid.review.doctor_choice import BY_MODEL
    from tunegrid.review.doctor_stop import stop

    rows = {FP32: {"modelled_step_s": 0.002, "tokens_per_s": 10.0}}
    fixes = [_fix({"precision": "fp32"}, FP32)]
    for theirs, stops in ((0.003, True), (0.002, False), (0.001, False), (None, True)):
        choice = {
            "failure": "nan",
            "ranked_by": BY_MODEL,
            "candidates": [
                _left({"precision": "fp32"}, FP32),
                _left({"precision": "bf16"}, BF16, modelled_step_s=theirs),
            ],
        }
        done, why = stop(choice, fixes, rows, [FP32], first=False)
        assert done is stops, theirs
    assert why == ["precision=bf16: not modelled on the target, above precision=fp32 (m_fp32_bs2_none_s0)'s 2 ms/step"]


def test_a_collective_timeout_stops_at_the_smallest_larger_timeout_that_holds():
    from tunegrid.review.doctor_choice import BY_ORDER
    from tunegrid.review.doctor_stop import stop

    seven, nine = "m_fp32_bs2_none_s0_ws2_ct7", "m_fp32_bs2_none_s0_ws2_ct9"
    choice = {
        "failure": "timeout:long_pause",
        "ranked_by": BY_ORDER,
        "candidates": [_left({"collective_timeout_s": 7}, seven), _left({"collective_timeout_s": 9}, nine)],
    }
    done, why = stop(choice, [_fix({"collective_timeout_s": 7}, seven)], {}, [seven], first=False)
    assert done and why[0].startswith("collective_timeout_s=9: ranked after collective_timeout_s=7")


@pytest.mark.parametrize(("fp32_step", "first"), [(0.95, "bf16"), (0.80, "fp32")])
def test_fixes_within_the_fastest_ones_noise_are_equally_fast_and_the_plans_order_picks(tmp_path, fp32_step, first):
    """fp32 5 % faster than bf16 is within its step times' 10 % deviation: bf16 first (nan_fix_rank 0 before 2), on
    any host; 20 % faster, fp32 first. The doctor and the grid read the same rule, so they name the same fix."""
    from tunegrid.review.doctor_verdict import verdict_of

    grid = {"model": ["gemma3-hot"], "precision": ["fp16", "bf16", "fp32"], "quant": ["none"]}
    study = resolve_study(make_study(grid=grid))
    nan = {"nan": {"step": 0, "kind": "loss_nonfinite", "origin": {"forward": {"module": "model.layers.7"}}}}
    losses = [2.14, 1.85, 1.55, 1.34, 1.30]
    spread = [2.0, 0.8 * fp32_step, fp32_step, 1.2 * fp32_step, fp32_step]  # step 0's warm-up is not counted
    results = [
        _cell_files(tmp_path, "gemma3-hot_fp16_bs2_none_s0", "nan", [float("nan")], [1], nan),
        _cell_files(tmp_path, "gemma3-hot_bf16_bs2_none_s0", "ok", losses, step_times=[2.0, 1.0, 1.0, 1.0, 1.0]),
        _cell_files(tmp_path, "gemma3-hot_fp32_bs2_none_s0", "ok", losses, step_times=spread),
    ]
    verdict = verdict_of(study, "gemma3-hot_fp16_bs2_none_s0", results, CAPABILITIES)
    assert verdict.fixes[0]["change"] == {"precision": first}, verdict.recommendations
    if first == "bf16":
        assert "fp32, bf16 within 10% of the fastest" in verdict.fixes[0]["recommendation"]


def test_a_cell_that_beat_its_own_ceiling_raises_every_ceiling_left():
    """The probe measured fp32 on a loaded host: bf16's own cell ran at twice its ceiling, so the floor of the
    candidates left is not trusted as it stands."""
    from tunegrid.review.doctor_stop import stop

    choice = _native_choice(900.0)
    choice["candidates"][0]["ceiling_tokens_per_s"] = 500.0  # bf16 measured 1000
    assert not stop(choice, PROVEN, ROWS, [BF16, FP32], first=False)[0]  # 900 x 2 > 950
    choice["candidates"][1]["ceiling_tokens_per_s"] = 400.0
    done, why = stop(choice, PROVEN, ROWS, [BF16, FP32], first=False)
    assert done and "at most 800 tokens/s here (its floor, x2.00: a cell here beat its own ceiling)" in why[0]


def test_candidates_of_one_bound_are_said_once():
    from tunegrid.review.doctor_stop import stop

    choice = _native_choice(900.0)
    choice["candidates"].insert(
        2, _left({"precision": "fp16-mixed"}, "m_fp16-mixed_bs2_none_s0", ceiling_tokens_per_s=900.0)
    )
    done, why = stop(choice, PROVEN, ROWS, [BF16, FP32], first=False)
    assert done and len(why) == 1 and why[0].startswith("precision=fp16-islands; precision=fp16-mixed: at most 900")
