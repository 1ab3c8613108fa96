"""The MoE regression's two provable fixes, from the grid's own cells: pin the library stack whose twin
quantized the experts (transformers 4.x), or quantize the fused experts on the new one (nf4-experts); each
with its evidence and its cost by stage. A twin on another stack that did not close the gap is no fix, and a
cell its stack could not run (unsupported) names the stack that ran it."""

from __future__ import annotations

import pandas as pd

from tunegrid.review.moe_advice import expert_gap
from tunegrid.review.stack_advice import stack_fixes

MIB = 2**20
V4 = "transformers-v4"


def _cell(quant, stack, outcome="ok", flagged=0.0, load=500, steady=500, tps=20.0):
    cell_id = f"moe_fp32_bs2_{quant}_s0" + (f"_stack-{stack}" if stack != "base" else "")
    weights = 55 + flagged
    return {
        "cell_id": cell_id,
        "model": "moe",
        "precision": "fp32",
        "batch_size": 2,
        "quant": quant,
        "seed": 0,
        "stack": stack,
        "stack_packages": "transformers==4.57.6" if stack == V4 else None,
        "outcome": outcome,
        "reason": "transformers 4.57.6 lacks transformers.core_model_loading.ConversionOps" if outcome != "ok" else "",
        "peak_bytes": max(load, steady) * MIB if outcome == "ok" else float("nan"),
        "load_peak_bytes": load * MIB if outcome == "ok" else float("nan"),
        "steady_peak_bytes": steady * MIB if outcome == "ok" else float("nan"),
        "tokens_per_s": tps if outcome == "ok" else float("nan"),
        "weight_bytes": weights * MIB,
        "expert_bytes": 380 * MIB,
        "flagged_bytes": flagged * MIB if outcome == "ok" else float("nan"),
        "flagged_share": flagged / weights if outcome == "ok" else float("nan"),
        "flagged_tensors": 6 if flagged else 0,
        "quality": "holds" if outcome == "ok" else None,
        "loss_deviation": 0.01 if outcome == "ok" else float("nan"),
    }


def _grid(v4_flagged=0.0):
    return pd.DataFrame(
        [
            _cell("nf4", "base", flagged=384.0, load=1106, steady=993, tps=12.5),
            _cell("nf4", V4, flagged=v4_flagged, load=1335, steady=709, tps=24.3),
            _cell("nf4-experts", "base", load=522, steady=930, tps=17.6),
            _cell("nf4-experts", V4, outcome="unsupported"),
        ]
    )


def test_both_fixes_of_the_moe_regression_are_named_with_evidence_and_cost():
    frame = _grid()
    (quantize,) = [fix for rec in expert_gap(frame) for fix in rec.fixes]
    assert quantize.change == {"quant": "nf4-experts"} and quantize.evidence == ["moe_fp32_bs2_nf4-experts_s0"]
    by_stack = {rec.signature: rec for rec in stack_fixes(frame)}
    pin = by_stack[f"stack:{V4}"]
    (fix,) = pin.fixes
    assert fix.change == {"stack": V4} and fix.evidence == [f"moe_fp32_bs2_nf4_s0_stack-{V4}"]
    assert "pin transformers==4.57.6" in fix.why
    assert round(fix.cost["steady_peak_bytes_ratio"], 2) == round(709 / 993, 2)
    assert round(fix.cost["load_peak_bytes_ratio"], 2) == round(1335 / 1106, 2)  # the load peak rose: said
    assert "full-precision weights 384 MiB -> 0" in pin.text.replace(".0 MiB", " MiB")
    # the cell transformers 4.x could not run names the stack that ran it
    back = by_stack["stack:base"]
    assert back.failing == [f"moe_fp32_bs2_nf4-experts_s0_stack-{V4}"]
    assert back.fixes[0].change == {"stack": "base"}


def test_a_twin_on_another_stack_that_left_the_experts_too_is_no_fix():
    by_stack = {rec.signature for rec in stack_fixes(_grid(v4_flagged=384.0))}
    assert f"stack:{V4}" not in by_stack


def test_the_stack_is_a_summary_column_and_mlflow_tags():
    from tunegrid.review.summary import summary_row
    from tunegrid.track.tags import axis_tags, run_tags

    axes = {"model": "moe", "precision": "fp32", "batch_size": 2, "quant": "nf4", "seed": 0, "stack": V4}
    stack = {"name": V4, "pins": {"transformers": "4.57.*"}, "versions": {"transformers": "4.57.6", "torch": "2.13.0"}}
    result = {"cell_id": "x", "cell": {"axes": axes}, "outcome": "ok", "reason": "", "env": {"stack": stack}}
    row = summary_row(result)
    assert row["stack"] == V4 and row["stack_packages"] == "transformers==4.57.6"
    assert axis_tags(axes)["stack"] == V4
    tags = run_tags(result)
    assert tags["stack.transformers"] == "4.57.6" and "stack.torch" not in tags  # what the stack pinned
    base = summary_row({**result, "cell": {"axes": {**axes, "stack": "base"}}, "env": {}})
    assert base["stack"] == "base" and base["stack_packages"] is None
