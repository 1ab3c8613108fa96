"""What a person reads: the recommender's advice never contradicts its evidence, alternatives stay apart,
and the report writes numbers and failures for people. Built on small hand-made summaries (the
columns `summary` writes), so each rule is checked on both of its branches."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from tunegrid.review.recommend import recommend
from tunegrid.review.report import ALL_CELLS_COLUMNS, failure_groups
from tunegrid.review.report_format import fmt as _fmt
from tunegrid.review.report_format import table as _table
from tunegrid.units import human_bytes

MIB = 2**20


def _cell(model="moe", precision="fp16", batch=8, quant="none", outcome="ok", accum=1, **extra):
    row = {
        "cell_id": f"{model}_{precision}_bs{batch}_{quant}_s0" + (f"_ga{accum}" if accum > 1 else ""),
        "model": model,
        "precision": precision,
        "batch_size": batch,
        "quant": quant,
        "seed": 0,
        "world_size": 1,
        "grad_accum": accum,
        "effective_batch": batch * accum,
        "outcome": outcome,
        "reason": "trained all steps with finite loss",
        "nan_step": float("nan"),
        "nan_kind": None,
        "nan_forward_module": None,
        "nan_backward_module": None,
        "target": "native",
        "flagged_share": 0.0,
        "flagged_tensors": 0,
        "expert_bytes": None,
        "weight_bytes": 100 * MIB,
        "peak_bytes": 800 * MIB,
        "oom_stage": None,
    }
    row.update(extra)
    return row


def _gap_frame(nf4_peak: int, experts_peak: int) -> pd.DataFrame:
    return pd.DataFrame(
        [
            _cell(
                quant="nf4",
                flagged_share=0.8,
                flagged_tensors=4,
                expert_bytes=80 * MIB,
                weight_bytes=90 * MIB,
                peak_bytes=nf4_peak,
            ),
            _cell(quant="nf4-experts", weight_bytes=30 * MIB, expert_bytes=20 * MIB, peak_bytes=experts_peak),
        ]
    )


def test_expert_quantization_is_recommended_only_where_the_peaks_fell():
    (fell,) = recommend(_gap_frame(nf4_peak=914 * MIB, experts_peak=792 * MIB))
    assert (
        fell.fixes[0].change == {"quant": "nf4-experts"}
        and fell.failing == []
        and fell.concerns == ["moe_fp16_bs8_nf4_s0"]
    )
    (rose,) = recommend(_gap_frame(nf4_peak=792 * MIB, experts_peak=914 * MIB))
    assert rose.fixes == [], "a memory fix whose measured peaks went up is not recommended"
    assert "792.0 MiB -> 914.0 MiB" in rose.text and "Not recommended" in rose.text


NATIVE = {"precision": {"bf16": "native", "fp16": "native", "fp32": "native"}}


def _fp16_overflow(batch=8, accum=1):
    return _cell(
        model="g",
        precision="fp16",
        batch=batch,
        accum=accum,
        outcome="nan",
        reason="non-finite loss",
        nan_step=9.0,
        nan_kind="loss_nonfinite",
        nan_forward_module="model.layers.0.mlp.down_proj",
    )


def test_nan_alternatives_are_separate_fixes_and_only_failed_cells_are_failing():
    frame = pd.DataFrame(
        [
            _fp16_overflow(),
            _cell(model="g", precision="fp16", batch=2, accum=4),
            _cell(model="g", precision="bf16", batch=8),
            _cell(model="g", precision="bf16", batch=2, accum=4),
        ]
    )
    (rec,) = recommend(frame, NATIVE)
    assert [fix.change for fix in rec.fixes] == [{"precision": "bf16"}, {"batch_size": 2, "grad_accum": 4}]
    assert rec.failing == ["g_fp16_bs8_none_s0"] and all(c != rec.failing[0] for c in rec.evidence)
    assert "()" not in rec.text and "()" not in rec.title


def test_a_smaller_micro_batch_keeps_the_effective_batch():
    frame = pd.DataFrame(
        [
            _fp16_overflow(),
            _cell(model="g", precision="fp16", batch=2),  # ok, but 2 sequences a step: another recipe
            _cell(model="g", precision="fp16", batch=2, accum=4),
            _cell(model="g", precision="fp16", batch=4, accum=2, outcome="nan"),
        ]
    )
    (rec,) = recommend(frame, NATIVE)
    (fix,) = rec.fixes
    assert fix.change == {"batch_size": 2, "grad_accum": 4} and fix.evidence == ["g_fp16_bs2_none_s0_ga4"]
    assert "keep fp16 with batch_size 2 with grad_accum 4" in rec.text and "effective batch of 8" in rec.text
    assert rec.failing == ["g_fp16_bs4_none_s0_ga2", "g_fp16_bs8_none_s0"]


def test_no_smaller_micro_batch_is_advised_that_the_grid_has_not_run_at_the_effective_batch():
    frame = pd.DataFrame([_fp16_overflow(), _cell(model="g", precision="fp16", batch=2)])
    (rec,) = recommend(frame, NATIVE)
    assert rec.fixes == [], "batch_size 2 alone changes the recipe; batch_size 2 x grad_accum 4 never ran"
    assert "effective batch of 2, not 8" in rec.text
    assert "no cell with batch_size 2 and grad_accum 4" in rec.text and "Fix:" not in rec.text
    # a summary written before the axis existed has no grad_accum column: every cell ran without accumulation
    old = frame.drop(columns=["grad_accum", "effective_batch"])
    (rec,) = recommend(old, NATIVE)
    assert rec.fixes == [] and "no cell with batch_size 2 and grad_accum 4" in rec.text


def test_numbers_are_written_for_people():
    assert _fmt(402_653_184, "peak_bytes") == "384.0 MiB" and human_bytes(13.97e9) == "13.0 GiB"
    assert _fmt(402653184.0, "weight bytes") == "384.0 MiB"
    assert _fmt(30.0, "steps_run") == "30" and _fmt(0.90612, "fp16_headroom_worst_ratio") == "0.906"
    assert _fmt(1563.39988, "tokens_per_s") == "1,563" and _fmt(float("inf"), "x") == "inf" and _fmt(None) == ""


def test_failures_are_grouped_by_cause_with_the_log_tail_and_path(tmp_path: Path):
    logs = tmp_path / "logs"
    logs.mkdir()
    reason = "RuntimeError: boom"
    frame = pd.DataFrame(
        [_cell(batch=b, outcome="error", reason=reason) for b in (2, 4, 8)]
        + [_cell(batch=16, outcome="timeout", reason="no progress")]
    )
    (logs / "moe_fp16_bs2_none_s0.log").write_text(
        "loading\rstep 1\rstep 2\nTraceback (most recent call last):\nRuntimeError: boom\n"
    )
    results = {
        "moe_fp16_bs2_none_s0": {"traceback": "Traceback (most recent call last):\n  File x\nRuntimeError: boom"}
    }
    groups = failure_groups(frame, results, logs)
    assert [(g["outcome"], len(g["cells"])) for g in groups] == [("error", 3), ("timeout", 1)]
    error = groups[0]
    assert error["reason"] == reason and error["log_path"].endswith("moe_fp16_bs2_none_s0.log")
    assert error["traceback_tail"].endswith("RuntimeError: boom") and "step 2" in error["log_tail"]


def test_the_table_of_all_cells_says_where_a_cell_resumed_and_its_effective_batch():
    rows = [_cell(batch=2, accum=4, resumed_from_step=3.0), _cell(batch=8, resumed_from_step=float("nan"))]
    page = _table(rows, [c for c in ALL_CELLS_COLUMNS if c in rows[0]])
    assert "<th>resumed from step</th>" in page and "<td class='num'>3</td>" in page
    assert "effective batch (micro-batch x accumulation x ranks)" in page and page.count("<td class='num'>8</td>") == 2


def test_a_column_of_bytes_has_one_unit_named_in_its_header_and_the_exact_bytes_on_hover():
    rows = [{"cell_id": c, "peak_bytes": b} for c, b in (("a", 900 * 2**10), ("b", 300 * 2**20), ("c", 2 * 2**30))]
    page = _table(rows, ["cell_id", "peak_bytes"])
    assert "peak memory (MiB)" in page and "title='MLflow metric: peak_bytes'" in page
    assert "<td class='num' title='921,600 bytes'>0.9</td>" in page  # the column's unit: no KiB and GiB beside it
    assert "<td class='num' title='2,147,483,648 bytes'>2,048.0</td>" in page


def test_out_of_memory_advice_keeps_the_effective_batch_too():
    oom = _cell(model="g", precision="bf16", batch=8, outcome="oom", reason="CUDA out of memory", peak_bytes=None)
    kept = _cell(model="g", precision="bf16", batch=2, accum=4, peak_bytes=300 * MIB)
    other = _cell(model="g", precision="bf16", batch=2, peak_bytes=290 * MIB)
    (rec,) = recommend(pd.DataFrame([oom, kept, other]), NATIVE)
    assert [fix.change for fix in rec.fixes] == [{"batch_size": 2, "grad_accum": 4}]
    assert "batch_size 2 with grad_accum 4 fits at the same effective batch of 8 (peak 300.0 MiB)" in rec.text
    (rec,) = recommend(pd.DataFrame([oom, other]), NATIVE)
    assert rec.fixes == [] and "batch_size 2 fits (g_bf16_bs2_none_s0), but at an effective batch of 2" in rec.text


def test_the_outcome_matrix_tells_accumulated_batches_apart():
    from tunegrid.review.plots import _matrix_layout, _sub_label

    frame = pd.DataFrame([_fp16_overflow(), _cell(model="g", precision="fp16", batch=2, accum=4)])
    _, cols, _, col_axes = _matrix_layout(frame)
    assert col_axes == ["precision", "batch_size", "grad_accum"]
    assert [_sub_label(col_axes[1:], c[1:]) for c in cols] == ["bs 2 x ga 4", "bs 8 x ga 1"]
    _, cols, _, col_axes = _matrix_layout(frame[frame["batch_size"] == 8])  # one accumulation: labels as before
    assert col_axes == ["precision", "batch_size"] and [_sub_label(col_axes[1:], c[1:]) for c in cols] == ["bs 8"]


def _oom_at_load_frame(twin_outcome: str) -> pd.DataFrame:
    failed = _cell(
        precision="bf16",
        batch=1,
        quant="nf4",
        outcome="oom",
        reason="RuntimeError during load: converting a checkpoint tensor: ... can't allocate memory",
        oom_stage="load",
        oom_peak_bytes=7900 * MIB,
        peak_bytes=float("nan"),
    )
    twin = _cell(precision="bf16", batch=1, quant="nf4-experts", outcome=twin_outcome, peak_bytes=5600 * MIB)
    twin["load_peak_bytes"] = 4300 * MIB
    if twin_outcome != "ok":
        twin.update(oom_stage="step", reason="out of memory", oom_peak_bytes=7950 * MIB)
    return pd.DataFrame([failed, twin])


def test_oom_at_load_gets_nf4_experts_only_where_its_twin_loaded_and_cites_both_load_peaks():
    (fixed,) = [r for r in recommend(_oom_at_load_frame("ok")) if r.signature == "oom"]
    assert fixed.failing == ["moe_bf16_bs1_nf4_s0"] and fixed.evidence == ["moe_bf16_bs1_nf4-experts_s0"]
    assert [f.change for f in fixed.fixes] == [{"quant": "nf4-experts"}]
    assert "out of memory at load" in fixed.title
    assert "load peak 4.2 GiB, where nf4 failed at 7.7 GiB" in fixed.text, fixed.text
    assert not [r for r in recommend(_oom_at_load_frame("oom")) if r.signature == "oom"], (
        "no fix the grid did not show working"
    )
