"""The out-of-memory advice ranks every memory fix the grid proved (an 8-bit optimizer, activation
checkpointing, both, quantization, a smaller micro-batch at the same effective batch) by throughput, each with its
peak, its cost and its loss parity against the setting that ran out of memory; a twin that also ran out of memory,
changed another axis, did not learn or deviates from its reference is no fix. A twin with no reference twin, or
at the reference settings itself, is compared with the activation-checkpointing twin (the failing setting's
arithmetic), else with the failing cell's finite steps."""

from __future__ import annotations

import pandas as pd

from tunegrid.review.memory_advice import memory_setting_rows
from tunegrid.review.recommend import recommend

MIB = 2**20


def _cell(
    optimizer="adamw",
    ac=False,
    outcome="ok",
    peak=500,
    tps=1000.0,
    quant="none",
    batch=4,
    accum=1,
    loss=2.0,
    quality="holds",
    deviation=0.01,
    loss_kind="full",
):
    cell_id = f"w_fp32_bs{batch}_{quant}_s0" + (f"_ga{accum}" if accum > 1 else "")
    cell_id += (f"_{optimizer}" if optimizer != "adamw" else "") + ("_ac" if ac else "")
    cell_id += f"_loss-{loss_kind}" if loss_kind != "full" else ""
    return {
        "cell_id": cell_id,
        "model": "w",
        "precision": "fp32",
        "batch_size": batch,
        "quant": quant,
        "seed": 0,
        "world_size": 1,
        "grad_accum": accum,
        "optimizer": optimizer,
        "activation_checkpointing": ac,
        "loss": loss_kind,
        "collective_timeout_s": 600.0,
        "fault": "debug",
        "effective_batch": batch * accum,
        "outcome": outcome,
        "reason": "out of memory" if outcome == "oom" else "trained all steps with finite loss",
        "oom_stage": "step" if outcome == "oom" else None,
        "peak_bytes": peak * MIB if outcome == "ok" else float("nan"),
        "tokens_per_s": tps if outcome == "ok" else float("nan"),
        "final_loss": loss,
        "optimizer_state_bytes": 10 * MIB,
        "estimate_over_measured": 1.1,
        "target": "native",
        "flagged_share": 0.0,
        "flagged_tensors": 0,
        "expert_bytes": None,
        "nan_step": float("nan"),
        # review/quality.py's verdict on an ok cell; the reference here is the plain adamw cell's ok twin
        "quality": quality if outcome == "ok" else None,
        "loss_deviation": deviation if outcome == "ok" and quality not in ("no reference", "did not learn") else None,
        "reference_cell": "w_ref" if outcome == "ok" and quality != "no reference" else None,
    }


def _curve(losses):
    return [{"step": s, "loss": v} for s, v in enumerate(losses)]


def test_oom_fixes_are_ranked_by_throughput_with_peak_and_loss_parity():
    frame = pd.DataFrame(
        [
            _cell(outcome="oom"),
            _cell(optimizer="adamw-8bit", peak=430, tps=950.0, deviation=0.012),
            _cell(ac=True, peak=300, tps=700.0, deviation=0.0),
            _cell(optimizer="adamw-8bit", ac=True, peak=250, tps=690.0),  # both memory settings: a fix too
            _cell(optimizer="adamw-8bit", quant="nf4", peak=200, tps=2000.0),  # a memory setting and quant: no twin
            _cell(optimizer="paged-adamw-8bit", outcome="oom"),  # did not fit: no fix
            _cell(batch=2, accum=2, peak=350, tps=800.0, quality="no reference"),
        ]
    )
    curves = {
        "w_fp32_bs4_none_s0": _curve([3.0, float("nan")]),
        "w_fp32_bs4_none_s0_adamw-8bit": _curve([3.01, 2.5, 2.2]),
        "w_fp32_bs4_none_s0_ac": _curve([3.0, 2.5, 2.2]),
        "w_fp32_bs2_none_s0_ga2": _curve([2.98, 2.5, 2.2]),
    }
    (rec,) = [r for r in recommend(frame, {}, curves) if r.failing == ["w_fp32_bs4_none_s0"]]
    assert [f.change for f in rec.fixes] == [
        {"optimizer": "adamw-8bit"},
        {"batch_size": 2, "grad_accum": 2},
        {"activation_checkpointing": True},
        {"optimizer": "adamw-8bit", "activation_checkpointing": True},
    ]
    first = rec.fixes[0].why
    assert "optimizer=adamw-8bit fits (peak 430.0 MiB), 950 tokens/s (1.00 of the fastest fix)" in first
    assert "loss within 1.2% of its reference w_ref" in first and "failing setting" not in first
    assert [f.parity for f in rec.fixes] == [0.012, 0.0, 0.0, 0.01]  # what recommendations.json carries
    assert rec.fixes[2].cost == {
        "tokens_per_s": 700.0,
        "tokens_per_s_ratio": 700.0 / 950.0,
        "peak_bytes": 300.0 * MIB,
        "against": "the fastest fix",
    }
    # no reference twin ran ok for the micro-batch fix: its loss against the activation-checkpointing twin's (the
    # failing setting's arithmetic), and the text says why
    assert (
        "no ok reference twin in this study to check its loss against; loss within 0.00% of w_fp32_bs4_none_s0_ac"
        in rec.fixes[1].why
    )
    assert "the failing cell logged only step 0's loss, before any update" in rec.fixes[1].why
    assert "700 tokens/s (0.74 of the fastest fix)" in rec.fixes[2].why
    assert "activation checkpointing on with" not in rec.fixes[3].why
    assert rec.fixes[3].why.startswith("optimizer=adamw-8bit with activation checkpointing on fits (peak 250.0 MiB)")
    assert "Ranked by throughput" in rec.text and "no evidence" not in rec.text
    assert rec.as_dict()["fixes"][0]["parity"] == 0.012


def test_an_ok_twin_that_did_not_learn_or_deviates_is_no_oom_fix():
    frame = pd.DataFrame(
        [
            _cell(outcome="oom"),
            _cell(optimizer="adamw-8bit", peak=430, tps=950.0, quality="did not learn"),  # fits, trained nothing
            _cell(ac=True, peak=300, tps=700.0, quality="deviates", deviation=0.4),
            _cell(batch=2, accum=2, peak=350, tps=800.0, quality="did not learn"),
        ]
    )
    (rec,) = recommend(frame, {}, {})
    assert rec.fixes == [] and rec.evidence == [] and "Fix:" not in rec.text
    assert (
        "A memory setting ran ok in w_fp32_bs4_none_s0_ac (deviates), w_fp32_bs4_none_s0_adamw-8bit (did not learn): "
        "no evidence of a fix" in rec.text
    )
    assert (
        "A smaller micro-batch at the same effective batch ran ok in w_fp32_bs2_none_s0_ga2 (did not learn)" in rec.text
    )
    # one that learned and matched its reference beside them is the only fix offered
    learned = pd.concat([frame, pd.DataFrame([_cell(optimizer="paged-adamw-8bit", peak=420, tps=900.0)])])
    (rec,) = recommend(learned, {}, {})
    assert [f.change for f in rec.fixes] == [{"optimizer": "paged-adamw-8bit"}]
    assert rec.evidence == ["w_fp32_bs4_none_s0_paged-adamw-8bit"]


def test_memory_settings_beside_their_plain_twin():
    frame = pd.DataFrame(
        [
            _cell(peak=500, tps=1000.0, loss=2.0),
            _cell(optimizer="adamw-8bit", peak=450, tps=900.0, loss=2.01),
            _cell(ac=True, peak=300, tps=750.0, loss=2.0),
            _cell(optimizer="adamw-8bit", ac=True, peak=250, tps=700.0, loss=2.01),
            _cell(loss_kind="chunked", peak=400, tps=980.0, loss=2.0),
        ]
    )
    rows = {r["setting"]: r for r in memory_setting_rows(frame)}
    assert set(rows) == {
        "adamw-8bit",
        "activation checkpointing",
        "adamw-8bit + activation checkpointing",
        "chunked loss",
    }
    assert rows["chunked loss"]["peak / plain"] == 0.8 and rows["chunked loss"]["plain cell"] == "w_fp32_bs4_none_s0"
    assert rows["activation checkpointing"]["peak / plain"] == 0.6
    assert rows["activation checkpointing"]["tokens/s / plain"] == 0.75
    assert abs(rows["adamw-8bit"]["final loss - plain"] - 0.01) < 1e-9


def _at_reference(**kwargs):
    """A cell at the study's reference settings (fp32, no quantization): quality.py compared it with itself."""
    cell = _cell(**kwargs)
    if cell["outcome"] == "ok":
        cell["reference_cell"], cell["loss_deviation"] = cell["cell_id"], 0.0
    return cell


def test_a_fix_at_the_reference_settings_is_compared_with_the_failing_settings_arithmetic():
    """The plain cell ran out of memory in its first step (no loss at all) and every fix sits at the reference
    settings (its own reference): the activation-checkpointing twin stands for the failing setting, the others are
    compared with it, and a self-comparison is never shown as parity."""
    frame = pd.DataFrame(
        [
            _at_reference(outcome="oom"),
            _at_reference(optimizer="adamw-8bit", peak=430, tps=500.0),
            _at_reference(ac=True, peak=300, tps=900.0),
            _at_reference(optimizer="adamw-8bit", ac=True, peak=250, tps=450.0),
        ]
    )
    curves = {
        "w_fp32_bs4_none_s0_adamw-8bit": _curve([3.0, 2.5, 2.3, 2.1]),
        "w_fp32_bs4_none_s0_ac": _curve([3.0, 2.5, 2.3, 2.0]),
        "w_fp32_bs4_none_s0_adamw-8bit_ac": _curve([3.0, 2.5, 2.3, 2.1]),
    }
    (rec,) = recommend(frame, {}, curves)
    assert [f.evidence for f in rec.fixes] == [
        ["w_fp32_bs4_none_s0_ac"],
        ["w_fp32_bs4_none_s0_adamw-8bit"],
        ["w_fp32_bs4_none_s0_adamw-8bit_ac"],
    ]
    stand_in, eight_bit, both = rec.fixes
    assert "of its reference w_fp32_bs4_none_s0_ac" not in stand_in.why and stand_in.parity is None
    assert "so this curve stands for the failing setting's (the failing cell ran no step)" in stand_in.why
    assert abs(eight_bit.parity - 0.05) < 1e-9  # 2.1 against 2.0 over the last quarter (one of four steps)
    assert "it is at the study's reference settings; loss within 5.00% of w_fp32_bs4_none_s0_ac" in eight_bit.why
    assert "the failing cell ran no step)" in eight_bit.why and abs(both.parity - 0.05) < 1e-9
    assert [round(f.cost["tokens_per_s_ratio"], 2) for f in rec.fixes] == [1.0, 0.56, 0.5]


def test_without_a_checkpointing_twin_the_failing_cells_finite_steps_are_the_parity():
    frame = pd.DataFrame([_at_reference(outcome="oom"), _at_reference(optimizer="adamw-8bit", peak=430, tps=500.0)])
    curves = {"w_fp32_bs4_none_s0": _curve([3.0, 2.6]), "w_fp32_bs4_none_s0_adamw-8bit": _curve([3.0, 2.5, 2.1])}
    (rec,) = recommend(frame, {}, curves)
    assert "it is at the study's reference settings: loss at step 1 2.5 vs 2.6 in the failing setting" in rec.text
    assert abs(rec.fixes[0].parity - 0.1 / 2.6) < 1e-9
    (rec,) = recommend(frame, {}, {"w_fp32_bs4_none_s0_adamw-8bit": _curve([3.0, 2.5, 2.1])})
    assert rec.fixes[0].parity is None and "loss 2.1 at step 2; the failing cell ran no step, nothing" in rec.text
    # a failing cell with step 0's loss only (before any update) has nothing to compare either
    (rec,) = recommend(
        frame, {}, {"w_fp32_bs4_none_s0": _curve([3.0]), "w_fp32_bs4_none_s0_adamw-8bit": _curve([3.0, 2.5, 2.1])}
    )
    assert rec.fixes[0].parity is None and "logged only step 0's loss, before any update, nothing" in rec.text


def test_the_chunked_loss_is_a_memory_fix_named_as_such():
    frame = pd.DataFrame(
        [
            _cell(outcome="oom"),
            _cell(loss_kind="chunked", peak=420, tps=990.0, deviation=0.0),
            _cell(ac=True, peak=300, tps=700.0, deviation=0.0),
        ]
    )
    (rec,) = recommend(frame, {}, {})
    assert [f.change for f in rec.fixes] == [{"loss": "chunked"}, {"activation_checkpointing": True}]
    assert "the chunked loss fits (peak 420" in rec.text


def test_a_fix_that_adds_settings_to_another_ranks_after_it_however_fast():
    """Checkpointing with 8-bit AdamW measured faster than checkpointing alone, which fits too: the one that changes
    less of the recipe is the recommendation (the doctor leaves the other unrun once checkpointing holds, and names
    the same fix); among fixes that add to none, throughput still decides."""
    frame = pd.DataFrame(
        [
            _cell(outcome="oom"),
            _cell(optimizer="adamw-8bit", outcome="oom"),  # alone it does not fit
            _cell(ac=True, peak=300, tps=700.0),
            _cell(optimizer="adamw-8bit", ac=True, peak=250, tps=750.0),
            _cell(batch=2, accum=2, peak=350, tps=720.0),
        ]
    )
    (rec,) = [r for r in recommend(frame, {}, {}) if r.failing == ["w_fp32_bs4_none_s0"]]
    assert [f.change for f in rec.fixes] == [
        {"batch_size": 2, "grad_accum": 2},
        {"activation_checkpointing": True},
        {"optimizer": "adamw-8bit", "activation_checkpointing": True},
    ]
    assert "750 tokens/s (1.00 of the fastest fix)" in rec.fixes[2].why
    assert "Ranked by throughput, fastest first; a fix that adds settings to another, after it." in rec.text
