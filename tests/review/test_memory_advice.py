"""The out-of-memory advice ranks every memory fix the grid proved (an 8-bit optimizer, activation
checkpointing, quantization, a smaller micro-batch at the same effective batch) by throughput, each with its
peak and loss parity; a twin that also ran out of memory, or that changed two settings, is no fix."""

from __future__ import annotations

import pandas as pd

from tunegrid.review.memory_advice import memory_setting_rows
from tunegrid.review.recommend import recommend

MIB = 2**20


def _cell(optimizer="adamw", ac=False, outcome="ok", peak=500, tps=1000.0, quant="none", batch=4, accum=1, loss=2.0):
    cell_id = f"w_fp32_bs{batch}_{quant}_s0" + (f"_ga{accum}" if accum > 1 else "")
    cell_id += (f"_{optimizer}" if optimizer != "adamw" else "") + ("_ac" if ac else "")
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
    }


def _curve(losses):
    return [{"step": s, "loss": v} for s, v in enumerate(losses)]


def test_oom_fixes_are_ranked_by_throughput_with_peak_and_loss_parity():
    frame = pd.DataFrame(
        [
            _cell(outcome="oom"),
            _cell(optimizer="adamw-8bit", peak=430, tps=950.0),
            _cell(ac=True, peak=300, tps=700.0),
            _cell(optimizer="adamw-8bit", ac=True, peak=250, tps=690.0),  # two settings changed: no twin
            _cell(optimizer="paged-adamw-8bit", outcome="oom"),  # did not fit: no fix
            _cell(batch=2, accum=2, peak=350, tps=800.0),
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
    ]
    first = rec.fixes[0].why
    assert "optimizer=adamw-8bit fits (peak 430.0 MiB), 950 tokens/s (1.00 of the fastest fix)" in first
    assert "loss at step 0 3.01 vs 3 in the failing setting" in first
    assert "700 tokens/s (0.74 of the fastest fix)" in rec.fixes[2].why
    assert "Ranked by throughput" in rec.text


def test_memory_settings_beside_their_plain_twin():
    frame = pd.DataFrame(
        [
            _cell(peak=500, tps=1000.0, loss=2.0),
            _cell(optimizer="adamw-8bit", peak=450, tps=900.0, loss=2.01),
            _cell(ac=True, peak=300, tps=750.0, loss=2.0),
            _cell(optimizer="adamw-8bit", ac=True, peak=250, tps=700.0, loss=2.01),
        ]
    )
    rows = {r["setting"]: r for r in memory_setting_rows(frame)}
    assert set(rows) == {"adamw-8bit", "activation checkpointing", "adamw-8bit + activation checkpointing"}
    assert rows["activation checkpointing"]["peak / plain"] == 0.6
    assert rows["activation checkpointing"]["tokens/s / plain"] == 0.75
    assert abs(rows["adamw-8bit"]["final loss - plain"] - 0.01) < 1e-9
