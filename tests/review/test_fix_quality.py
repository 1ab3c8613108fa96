"""A fix is a claim: only ok cells that learned and matched their reference twin are evidence, bf16 is never
offered to a target without it, and the fix that holds at the best measured throughput comes first."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from test_review import _cell, _fp16_overflow

from tunegrid.review.quality import default_review, loss_deviation, loss_fall, quality_columns
from tunegrid.review.recommend import recommend
from tunegrid.review.summary import build_summary

DEFAULT_REVIEW = default_review()

NATIVE = {"precision": {"bf16": "native", "fp16": "native", "fp32": "native"}}
H100_PROBE = NATIVE  # a probe on a GPU with native bf16, while the study targets a T4


def test_learned_is_the_fall_from_step_0_to_the_last_quarter_and_parity_is_the_last_quarter_deviation():
    curve = [10.0, 9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0]  # last quarter: 4, 3
    assert loss_fall(curve) == pytest.approx(1 - 3.5 / 10)
    assert loss_fall([187.7, 187.6, 187.5, 187.5]) < DEFAULT_REVIEW["min_loss_fall"]  # ok, but trained nothing
    reference = [10.0, 9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 2.0]
    assert loss_deviation(curve, reference) == pytest.approx((0 / 4 + 1 / 2) / 2)
    rows = [
        {"cell_id": "ref", "outcome": "ok", "precision": "fp32", "quant": "none", "model": "g", "batch_size": 2},
        {
            "cell_id": "same",
            "outcome": "ok",
            "precision": "fp16-islands",
            "quant": "none",
            "model": "g",
            "batch_size": 2,
        },
        {"cell_id": "flat", "outcome": "ok", "precision": "bf16", "quant": "none", "model": "g", "batch_size": 2},
        {"cell_id": "off", "outcome": "ok", "precision": "bf16", "quant": "nf4", "model": "g", "batch_size": 2},
        {"cell_id": "lone", "outcome": "ok", "precision": "bf16", "quant": "none", "model": "g", "batch_size": 8},
        {"cell_id": "bad", "outcome": "nan", "precision": "fp16", "quant": "none", "model": "g", "batch_size": 2},
    ]
    curves = {
        "ref": reference,
        "same": [v * 1.01 for v in reference],
        "flat": [10.0] * 8,
        "off": [v * 1.5 for v in reference],
        "lone": curve,
        "bad": [float("nan")],
    }
    by_id = {row["cell_id"]: q for row, q in zip(rows, quality_columns(rows, curves, DEFAULT_REVIEW), strict=True)}
    assert by_id["ref"]["quality"] == "holds" and by_id["ref"]["loss_deviation"] == 0
    assert by_id["same"]["quality"] == "holds" and by_id["same"]["reference_cell"] == "ref"
    assert by_id["flat"]["quality"] == "did not learn" and by_id["flat"]["learned"] is False
    assert by_id["off"]["quality"] == "deviates" and by_id["off"]["within_tolerance"] is False
    assert by_id["lone"]["quality"] == "no reference" and by_id["lone"]["reference_cell"] is None
    assert by_id["bad"]["quality"] is None  # not ok: no verdict on what it learned


def test_the_summary_reads_each_cells_curve_and_the_studys_review_settings(tmp_path):
    paths = []
    for cell_id, precision, losses in (("ref", "fp32", [4.0, 3.0, 2.0, 1.0]), ("half", "bf16", [4.0, 3.0, 2.0, 1.5])):
        run = tmp_path / cell_id
        run.mkdir()
        axes = {"model": "g", "precision": precision, "batch_size": 2, "quant": "none", "seed": 0}
        result = {"cell_id": cell_id, "cell": {"axes": axes}, "outcome": "ok", "reason": "ok"}
        (run / "result.json").write_text(json.dumps(result))
        (run / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": i, "loss": v}) + "\n" for i, v in enumerate(losses))
        )
        paths.append(run / "result.json")
    frame = build_summary(paths).set_index("cell_id")
    assert frame.loc["half", "quality"] == "deviates" and frame.loc["half", "loss_deviation"] == pytest.approx(0.5)
    loose = build_summary(paths, review={**DEFAULT_REVIEW, "loss_tolerance": 0.6}).set_index("cell_id")
    assert loose.loc["half", "quality"] == "holds"


def _fix_frame(islands_tokens=90.0, fp32_tokens=50.0, bf16_quality="holds", islands_quality="holds"):
    fail = {**_fp16_overflow(), "tokens_per_s": 100.0, "peak_bytes": 1000.0}
    return pd.DataFrame(
        [
            fail,
            _cell(model="g", precision="bf16", quality=bf16_quality, loss_deviation=0.01, tokens_per_s=120.0),
            _cell(
                model="g",
                precision="fp16-islands",
                quality=islands_quality,
                loss_deviation=0.002,
                tokens_per_s=islands_tokens,
                peak_bytes=1100.0,
                fp32_islands="model.layers.0.mlp.down_proj",
            ),
            _cell(
                model="g",
                precision="fp32",
                quality="holds",
                loss_deviation=0.0,
                tokens_per_s=fp32_tokens,
                peak_bytes=1800.0,
            ),
        ]
    )


def test_an_ok_cell_that_did_not_learn_is_no_evidence_of_a_fix():
    (rec,) = recommend(_fix_frame(bf16_quality="did not learn"), NATIVE)
    assert [fix.change["precision"] for fix in rec.fixes] == ["fp16-islands", "fp32"]
    assert "g_bf16_bs8_none_s0" not in rec.evidence
    assert "g_bf16_bs8_none_s0 (did not learn): no evidence of a fix" in rec.text
    (rec,) = recommend(_fix_frame(islands_quality="deviates"), NATIVE)
    assert [fix.change["precision"] for fix in rec.fixes] == ["bf16", "fp32"]


def test_the_fastest_fix_that_holds_comes_first_with_its_parity_and_cost():
    (rec,) = recommend(_fix_frame(), NATIVE)
    assert [fix.change["precision"] for fix in rec.fixes] == ["bf16", "fp16-islands", "fp32"]
    islands = rec.fixes[1]
    assert islands.cost == {"tokens_per_s_ratio": 0.9, "peak_bytes_ratio": pytest.approx(1.1), "against": "fp16"}
    assert islands.parity == 0.002 and "layers.0.mlp.down_proj" in islands.why
    assert "loss within 0.2% of the reference" in islands.why and "0.90x the tokens/s" in islands.why
    (rec,) = recommend(_fix_frame(islands_tokens=40.0), NATIVE)
    assert [fix.change["precision"] for fix in rec.fixes] == ["bf16", "fp32", "fp16-islands"]
    assert "Ranked by throughput among the fixes that hold: bf16 first" in rec.text


def test_a_failure_in_its_first_step_is_costed_against_its_fp32_twin():
    frame = _fix_frame()
    frame.loc[frame["precision"] == "fp16", "tokens_per_s"] = float("nan")  # stopped before a timed step
    (rec,) = recommend(frame, NATIVE)
    islands = next(fix for fix in rec.fixes if fix.change["precision"] == "fp16-islands")
    assert islands.cost == {
        "tokens_per_s_ratio": 1.8,
        "peak_bytes_ratio": pytest.approx(1100 / 1800),
        "against": "fp32",
    }
    assert "1.80x the tokens/s and 0.61x the peak memory of fp32 in this grid" in islands.why
    # fp32 is offered too, but never costed against itself ("1.00x of fp32")
    fp32 = next(fix for fix in rec.fixes if fix.change["precision"] == "fp32")
    assert "of fp32 in this grid" not in fp32.why and "the baseline the other fixes' cost is measured" in fp32.why
    assert fp32.cost["tokens_per_s_ratio"] is None and fp32.cost["against"] == "itself: the baseline of the others"
    # the ranking names the baseline the ratios were measured against, never the failing setting it stands for
    ranking = next(s for s in rec.text.split(". ") if s.startswith("Ranked by"))
    assert "the tokens/s of fp32, measured in this grid" in ranking and "of fp16" not in ranking, ranking
    assert "fp32 1.00x" in ranking, ranking


def test_a_t4_target_is_never_offered_bf16_even_from_a_probe_that_has_it():
    t4 = _fix_frame().assign(target="t4")
    (rec,) = recommend(t4, H100_PROBE)
    assert [fix.change["precision"] for fix in rec.fixes] == ["fp16-islands", "fp32"]
    assert all("bf16" not in fix.why for fix in rec.fixes)
    assert "target t4 has emulated bf16" in rec.text
    # the probed device decides too: a native target on a machine that only emulates bf16
    (rec,) = recommend(_fix_frame(), {"precision": {"bf16": "emulated", "fp16": "native", "fp32": "native"}})
    assert "bf16" not in [fix.change["precision"] for fix in rec.fixes]


def test_a_smaller_micro_batch_or_expert_quantization_that_did_not_learn_is_no_fix():
    from test_review import _gap_frame

    MIB = 2**20
    frame = pd.DataFrame(
        [_fp16_overflow(), _cell(model="g", precision="fp16", batch=2, accum=4, quality="did not learn")]
    )
    (rec,) = recommend(frame, NATIVE)
    assert rec.fixes == [] and "Fix:" not in rec.text
    assert "batch ran ok in g_fp16_bs2_none_s0_ga4 (did not learn): no evidence of a fix" in rec.text
    held = frame.assign(quality="holds", loss_deviation=0.02, reference_cell="g_fp32_bs2_none_s0_ga4")
    (rec,) = recommend(held, NATIVE)
    assert rec.fixes[0].parity == 0.02 and "loss within 2.0% of its reference g_fp32_bs2_none_s0_ga4" in rec.text

    gap = _gap_frame(nf4_peak=914 * MIB, experts_peak=792 * MIB)
    gap["quality"], gap["loss_deviation"], gap["reference_cell"] = "deviates", 0.3, "moe_fp32_bs8_none_s0"
    (rec,) = recommend(gap)
    assert rec.fixes == [] and rec.evidence == [] and rec.concerns == ["moe_fp16_bs8_nf4_s0"]  # the finding stays
    assert "quant=nf4-experts ran ok in moe_fp16_bs8_nf4-experts_s0 (deviates): no evidence of a fix" in rec.text
    gap["quality"], gap["loss_deviation"] = "holds", 0.03
    (rec,) = recommend(gap)
    assert rec.fixes[0].parity == 0.03 and "loss within 3.0% of its reference moe_fp32_bs8_none_s0" in rec.fixes[0].why


def _write_cell(tmp_path, cell_id, precision, lines, outcome="ok", quant="none", diagnosis=None):
    """A cell's result.json and metrics.jsonl; `lines` are (loss, skipped_steps so far) per step."""
    run = tmp_path / cell_id
    run.mkdir()
    axes = {"model": "g", "precision": precision, "batch_size": 2, "quant": quant, "seed": 0}
    result = {"cell_id": cell_id, "cell": {"axes": axes}, "outcome": outcome, "reason": outcome}
    if diagnosis:
        result["diagnosis"] = diagnosis
    (run / "result.json").write_text(json.dumps(result))
    (run / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": i, "loss": loss, "skipped_steps": skipped}) + "\n"
            for i, (loss, skipped) in enumerate(lines)
        )
    )
    return run / "result.json"


# The measured recipe (axolotl QLoRA, fp16, 4 steps, Gemma 3 270M): fp16-mixed's GradScaler skipped steps 0-2
# (65536 -> 8192), so only step 3 updated; fp32 learned 2.14 -> 1.34.
FP32_CURVE = [(2.14, 0), (1.85, 0), (1.55, 0), (1.34, 0)]
WARM_UP_ONLY = [(2.14, 1), (2.20, 2), (2.21, 3), (2.21, 3)]  # 3 of 4 steps skipped, the old loop's end
SETTLED = [*WARM_UP_ONLY, (1.86, 3), (1.56, 3), (1.35, 3)]  # the loop now makes up the 3 skips: 4 updates


def test_a_cell_whose_scaler_skipped_3_of_its_4_steps_is_not_judged_on_its_warm_up(tmp_path):
    """The loss after a skipped step is the loss before an update: 3 skips of 4 leave no loss measured after
    any update, which says nothing about learning (it was 'did not learn')."""
    paths = [
        _write_cell(tmp_path, "g_fp32_bs2_none_s0", "fp32", FP32_CURVE),
        _write_cell(tmp_path, "g_fp16-mixed_bs2_none_s0", "fp16-mixed", WARM_UP_ONLY),
    ]
    row = build_summary(paths).set_index("cell_id").loc["g_fp16-mixed_bs2_none_s0"]
    assert row["quality"] == "too few updates", row["quality"]
    assert row["quality"] != "did not learn" and not row["learned"]
    assert row["quality_note"] == "3 steps the GradScaler skipped left out: no loss was measured after an update"


def test_a_fix_is_judged_on_its_updates_so_fp16_mixed_holds_once_its_scaler_settled(tmp_path):
    """Skipped steps are left out of the curve: the k-th loss is after k updates in both cells, so the fp16
    cell's last quarter is compared with the reference's after as many updates (it was 'deviates': its step 3,
    before any update, against fp32's after three)."""
    paths = [
        _write_cell(tmp_path, "g_fp32_bs2_none_s0", "fp32", FP32_CURVE),
        _write_cell(tmp_path, "g_fp16-mixed_bs2_none_s0", "fp16-mixed", SETTLED),
    ]
    frame = build_summary(paths).set_index("cell_id")
    row = frame.loc["g_fp16-mixed_bs2_none_s0"]
    assert row["quality"] == "holds", (row["quality"], row["loss_deviation"])
    assert row["loss_fall"] == pytest.approx(1 - 1.35 / 2.14)
    assert row["loss_deviation"] == pytest.approx(abs(1.35 - 1.34) / 1.34)
    assert "judged on the loss before and after 3 updates" in row["quality_note"]
    assert pd.isna(frame.loc["g_fp32_bs2_none_s0", "quality_note"])  # nothing skipped, nothing left out


def test_the_curve_judged_keeps_step_0_and_each_loss_after_an_update():
    from tunegrid.review.quality import trained_curve

    lines = [{"step": i, "loss": float(i), "skipped_steps": s} for i, s in enumerate([0, 1, 1, 2, 2])]
    # step 1 skipped: step 2's loss is after the same one update as step 1's (left out); likewise step 4's
    assert trained_curve(lines) == ([0.0, 1.0, 3.0], 2)
    assert trained_curve([{"step": 0, "loss": 5.0}, {"step": 1, "loss": 4.0}]) == ([5.0, 4.0], 0)  # older lines
