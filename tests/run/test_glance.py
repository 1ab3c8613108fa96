"""The end of a run at a glance: the counts, the failures grouped, the report's path."""

from __future__ import annotations

from pathlib import Path

from tunegrid.run.glance import glance
from tunegrid.runtime.files import write_json


def _result(study_dir: Path, cell_id: str, outcome: str, reason: str) -> None:
    write_json(study_dir / "runs" / cell_id / "result.json", {"outcome": outcome, "reason": reason})


def test_glance_counts_outcomes_groups_reasons_and_names_the_report(tmp_path: Path):
    for i in range(5):
        _result(tmp_path, f"m_fp32_bs{i}", "ok", "trained all 4 steps with finite loss")
    for step in range(4):
        _result(tmp_path, f"m_fp16_bs{step}", "nan", f"loss non-finite at step {step} in layers.0.mlp.down_proj")
    _result(tmp_path, "m_bf16_bs8", "oom", "out of memory at stage load after 8.2 GiB")
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "index.html").write_text("<html></html>")
    cells = [p.name for p in (tmp_path / "runs").iterdir()] + ["m_never_ran"]
    lines = glance("s", tmp_path, sorted(cells))
    assert lines[0] == "tunegrid study 's': 10 cells: 5 ok, 4 nan, 1 oom (1 without a result)"
    nan_line = next(line for line in lines if line.startswith("  nan"))
    # the four nan cells differ only by their step: one group, one line, three cells named and one counted; the
    # steps they differ in read as their range, the layer they share as it is
    assert nan_line.startswith("  nan x4: loss non-finite at step 0..3 in layers.0.mlp.down_proj [")
    assert nan_line.endswith("and 1 more]")
    assert any(line.startswith("  oom x1: out of memory at stage load") for line in lines)
    assert lines[-1] == f"report: {tmp_path / 'report' / 'index.html'}"


def test_glance_is_silent_before_any_cell_ran(tmp_path: Path):
    assert glance("s", tmp_path, ["a", "b"]) == []


def test_a_grouped_line_shows_each_cells_own_numbers(tmp_path: Path):
    """Two cells timing out the same way at different limits and steps: each one's figure, in the order the cells
    are named, never the first cell's numbers for both (collective-timeout-cpu's ct5 and ct7 slow-rank twins)."""
    reason = (
        "collective timeout after {} s in ALLREDUCE at step {}: rank(s) 1 did not arrive; straggler: rank 1 was {}x"
    )
    _result(tmp_path, "q_ct5_fault-slow-rank", "timeout", reason.format(5, 3, 13.5))
    _result(tmp_path, "q_ct7_fault-slow-rank", "timeout", reason.format(7, 4, 13.5))
    lines = glance("s", tmp_path, ["q_ct5_fault-slow-rank", "q_ct7_fault-slow-rank"])
    assert lines[1] == (
        "  timeout x2: collective timeout after 5/7 s in ALLREDUCE at step 3/4: rank(s) 1 did not arrive; "
        "straggler: rank 1 was 13.5x [q_ct5_fault-slow-rank, q_ct7_fault-slow-rank]"
    )
