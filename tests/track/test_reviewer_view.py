"""What a reviewer sees in MLflow: a `fault` tag only where a fault is injected, and the outcome filter finding
exactly the cells of the study's latest grid."""

from __future__ import annotations

from tunegrid.study.config import resolve_study
from tunegrid.study.grid_axes import cell_debug
from tunegrid.track.current import CURRENT_TAG, SUPERSEDED_OUTCOME_TAG, mark_current
from tunegrid.track.tags import axis_tags
from tunegrid.track.tracking import CELL_TAG

AXES = {"model": "m", "precision": "fp16", "batch_size": 2, "quant": "none", "seed": 0, "fault": "debug"}


def _debug(**changes):
    debug = resolve_study({"study": "s", "models": {"m": {"source": "synthetic"}}, "grid": {"model": ["m"]}})["debug"]
    return {**debug, **changes}


def test_no_fault_tag_where_nothing_is_injected():
    tags = axis_tags(AXES, cell_debug(_debug(), "debug"))
    assert "fault" not in tags and "fault.injected" not in tags


def test_an_injected_fault_is_tagged_with_what_it_injects():
    debug = _debug(inject_nonfinite={**_debug()["inject_nonfinite"], "module": "model.layers.0.mlp.down_proj"})
    tags = axis_tags(AXES, cell_debug(debug, "debug"))
    assert tags["fault"] == "debug" and tags["fault.injected"] == "inject_nonfinite"
    slow = _debug(slow_rank={"rank": 1, "seconds": 0.5, "growth_s": 0})
    tags = axis_tags({**AXES, "fault": "slow-rank", "world_size": 2}, cell_debug(slow, "slow-rank"))
    assert tags["fault"] == "slow-rank" and tags["fault.injected"] == "slow_rank"
    twin = axis_tags({**AXES, "fault": "none", "world_size": 2}, cell_debug(slow, "none"))
    assert twin["fault"] == "none" and "fault.injected" not in twin  # the grid's own value tells twins apart


def test_runs_of_cells_left_out_of_the_grid_no_longer_answer_the_outcome_filter(tmp_path, sqlite_store):
    from tunegrid.track.store import client, init_experiment

    uri = sqlite_store(tmp_path / "mlflow.db")
    experiment = init_experiment(uri, "tunegrid/s", tmp_path / "artifacts")
    c = client(uri)

    def cell_run(cell_id, outcome):
        run = c.create_run(experiment, run_name=cell_id, tags={CELL_TAG: cell_id, "outcome": outcome})
        return run.info.run_id

    kept, left_out, ok = cell_run("a_fp16", "nan"), cell_run("b_fp16", "nan"), cell_run("a_fp32", "ok")
    counts = mark_current(uri, experiment, {"a_fp16": kept, "a_fp32": ok})
    assert counts == {"current": 2, "left_out": 1}
    nan = c.search_runs([experiment], "tags.outcome = 'nan'")
    assert [r.info.run_id for r in nan] == [kept]
    old = c.get_run(left_out).data.tags
    assert old[CURRENT_TAG] == "no" and old[SUPERSEDED_OUTCOME_TAG] == "nan" and "outcome" not in old
    assert c.get_run(kept).data.tags[CURRENT_TAG] == "yes"
    assert mark_current(uri, experiment, {"a_fp16": kept, "a_fp32": ok}) == counts  # again: nothing changes


def test_a_run_name_keeps_what_tells_the_cells_apart():
    from tunegrid.track.tags import distinct_part, run_name

    ids = ["gemma3-tiny_fp16_bs8_nf4_s0", "gemma3-tiny_fp32_bs8_nf4_s0", "gemma3-tiny_fp16_bs8_none_s0"]
    assert run_name("nan", ids[0], ids) == "nan · fp16_nf4"
    assert run_name("ok", ids[1], ids) == "ok · fp32_nf4"
    assert run_name("ok", ids[0]) == f"ok · {ids[0]}"  # alone (a cell run by hand): its whole id
    # parts shared by every id go; a name that would be empty keeps the whole id
    assert distinct_part("m_fp16_s0", ["m_fp16_s0", "m_fp16_s0_ac"]) == "m_fp16_s0"
    assert distinct_part("m_fp16_s0_ac", ["m_fp16_s0", "m_fp16_s0_ac"]) == "ac"
