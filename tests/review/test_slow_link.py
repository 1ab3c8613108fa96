"""A slow link (distributed.slow_link, tunegrid.run.link_check) reaches summary.csv, the run tags and the report's
findings."""

from __future__ import annotations

import pandas as pd

from tunegrid.review.summary import summary_row, typed
from tunegrid.review.timeout_advice import timeout_fixes
from tunegrid.track.tags import run_tags

LINK = {"ratio": 12.5, "collective_s_median": 0.49, "predicted_s": 0.04, "gradient_bytes": 1000}
CELL = {
    "cell_id": "q_fp32_bs2_none_s0_ws2",
    "cell": {"axes": {"model": "q", "precision": "fp32", "batch_size": 2, "quant": "none", "seed": 0}},
    "outcome": "ok",
    "reason": "trained",
    "env": {},
    "distributed": {"world_size": 2, "slow_link": LINK},
}


def test_a_slow_link_is_a_summary_column_a_tag_and_a_finding():
    row = summary_row(CELL)
    assert row["slow_link_ratio"] == 12.5 and row["slow_link_collective_s"] == 0.49
    assert run_tags(CELL)["slow_link.ratio"] == "12.5" and run_tags(CELL)["slow_link.collective_s"] == "0.49"
    plain = summary_row({**CELL, "cell_id": "plain", "distributed": {"world_size": 2}})
    assert plain["slow_link_ratio"] is None and "slow_link.ratio" not in run_tags({**CELL, "distributed": {}})
    frame = typed(pd.DataFrame([row, plain]))
    findings = [r for r in timeout_fixes(frame) if r.signature == "warning:slow_link"]
    assert [f.concerns for f in findings] == [[CELL["cell_id"]]] and "12.5x" in findings[0].text
