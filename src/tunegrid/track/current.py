"""Which MLflow runs are the study's current ones: after the grid, the runs of its cells are tagged current and
any other cell run of the experiment is not, its outcome tag moved aside so the outcome filter finds the report's
cells only."""

from __future__ import annotations

from tunegrid.track.store import client, with_retries
from tunegrid.track.tracking import CELL_TAG

CURRENT_TAG = "tunegrid.current"  # yes: the run is its cell's in the study's latest grid; no: it is not
SUPERSEDED_OUTCOME_TAG = "superseded.outcome"


def mark_current(uri: str, experiment_id: str, current_runs: dict[str, str]) -> dict[str, int]:
    """After the grid: the runs of its cells are tagged current; any other cell run of the experiment (a cell a
    `--config` override or an edited grid left out) is tagged not current and its `outcome` tag is moved to
    `superseded.outcome`, so the filter `tags.outcome = 'nan'` finds the cells of the report and no others."""
    from mlflow.entities import ViewType

    c = client(uri)
    runs, token = [], None
    while True:
        page = with_retries(
            lambda t=token: c.search_runs(
                [experiment_id], f"tags.`{CELL_TAG}` != ''", ViewType.ACTIVE_ONLY, max_results=1000, page_token=t
            ),
            "search cell runs",
        )
        runs += list(page)
        token = page.token
        if not token:
            break
    counts = {"current": 0, "left_out": 0}
    wanted = set(current_runs.values())
    for run in runs:
        run_id, tags = run.info.run_id, run.data.tags
        if run_id in wanted:
            counts["current"] += 1
            if tags.get(CURRENT_TAG) != "yes":
                with_retries(lambda r=run_id: c.set_tag(r, CURRENT_TAG, "yes"), "tag current run")
            continue
        counts["left_out"] += 1
        if tags.get(CURRENT_TAG) != "no":
            with_retries(lambda r=run_id: c.set_tag(r, CURRENT_TAG, "no"), "tag left-out run")
        if "outcome" in tags:
            outcome = tags["outcome"]
            with_retries(lambda r=run_id, o=outcome: c.set_tag(r, SUPERSEDED_OUTCOME_TAG, o), "keep outcome")
            with_retries(lambda r=run_id: c.delete_tag(r, "outcome"), "untag outcome")
    return counts
