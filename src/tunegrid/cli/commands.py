"""What each `tunegrid <command>` does: one function per command, each a thin call into the wing that owns
the stage (prepare, run, track, review). The argument parser that dispatches to them is tunegrid.cli.main.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tunegrid.runtime.files import read_json, write_json
from tunegrid.study.errors import ConfigError


def dataset(args: argparse.Namespace) -> None:
    from tunegrid.prepare.datasets_io import write_study_dataset

    data = json.loads(args.data_spec) if args.data_spec else {"source": "synthetic"}
    if data["source"] == "synthetic":  # the flags, when given, are the generator's settings
        data = {
            **data,
            "examples": args.examples or data.get("examples", 512),
            "seed": data.get("seed", 0) if args.seed is None else args.seed,
        }
    count = write_study_dataset(args.out, data)
    print(f"dataset {args.out}: {count} records from {data['source']}")


def checkpoint(args: argparse.Namespace) -> None:
    from tunegrid.dataset import read_dataset
    from tunegrid.prepare.checkpoints import produce_checkpoint
    from tunegrid.prepare.data import corpus_texts

    spec = json.loads(args.spec)
    texts = list(corpus_texts(read_dataset(args.data)))
    manifest = produce_checkpoint(spec, texts, Path(args.out), f"models.{Path(args.out).name}")
    print(f"checkpoint {args.out}: {len(manifest['files'])} files, source {manifest['source']['kind']}")


def environment(args: argparse.Namespace) -> None:
    from tunegrid.prepare.environment import full_env

    env = full_env()
    Path(args.freeze).write_text("\n".join(env["all_packages"]) + "\n")
    write_json(args.out, env)


def stack(args: argparse.Namespace) -> None:
    from tunegrid.prepare.stacks import write_stack

    write_stack(args.name, json.loads(args.pins), args.results, Path(args.record), Path(args.freeze))


def probe(args: argparse.Namespace) -> None:
    from tunegrid.run.calibration_cache import probe_record

    record = probe_record(args.budget_s, args.world_sizes)
    write_json(args.out, record)
    print(f"probe: device {record['device']}, precision {record['precision']}, {record['probe_seconds']:.1f} s")


def tracking_init(args: argparse.Namespace) -> None:
    from tunegrid.track.store import init_experiment, redact_uri, resolve_tracking_uri

    uri = resolve_tracking_uri(args.tracking_uri)
    experiment_id = init_experiment(uri, args.experiment, Path(args.artifact_root))
    write_json(
        args.out,
        {
            "tracking_uri": redact_uri(uri),
            "experiment_name": args.experiment,
            "experiment_id": experiment_id,
            "system_metrics_interval_s": args.system_metrics_interval_s,
        },
    )
    print(f"MLflow experiment {args.experiment!r} (id {experiment_id}) in {redact_uri(uri)}")


def finetune(args: argparse.Namespace) -> None:
    from tunegrid.run.supervisor import run_cell

    result = run_cell(Path(args.contract), command=[sys.executable, *sys.argv])
    print(f"cell {result['cell_id']}: {result['outcome']} — {result['reason']}")


def worker(args: argparse.Namespace) -> None:
    from tunegrid.cell.train import run_worker
    from tunegrid.contract import CellContract

    run_worker(CellContract.read(args.contract))


def summary(args: argparse.Namespace) -> None:
    from tunegrid.review.summary import write_summary

    review = json.loads(args.review) if args.review else None
    frame = write_summary(args.results, args.out, sync_path=args.sync or None, review=review)
    print(frame[["cell_id", "outcome", "final_loss", "nan_step", "peak_bytes"]].to_string(index=False))
    print("outcomes:", frame["outcome"].value_counts().to_dict())


def sync(args: argparse.Namespace) -> None:
    from tunegrid.track.current import mark_current
    from tunegrid.track.store import tracking_uri_for_cells
    from tunegrid.track.tracking import sync_cell

    tracking = read_json(args.tracking)
    uri = tracking_uri_for_cells(tracking)
    report = {}
    for path in map(Path, args.results):
        result = read_json(path)
        log = Path(args.logs) / f"{result['cell_id']}.log" if args.logs else None
        report[result["cell_id"]] = sync_cell(uri, tracking["experiment_id"], result, path.parent, log)
    current = {cell: r["run_id"] for cell, r in report.items() if r["run_id"]}
    try:
        marked = mark_current(uri, tracking["experiment_id"], current)
    except Exception as exc:  # noqa: BLE001 — a store that stays down costs only the tags; the files hold it all
        marked = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    print(f"MLflow runs of this grid marked current: {marked}")
    write_json(args.out, report)
    created = sum(r["created"] for r in report.values())
    filled = sum(r["points_filled"] for r in report.values())
    failed = [cell for cell, r in report.items() if r["errors"]]
    print(
        f"MLflow sync: {len(report)} cells, {created} runs created, {filled} metric points filled, {len(failed)} failed"
    )


def mlflow_review(args: argparse.Namespace) -> None:
    from tunegrid.track.store import tracking_uri_for_cells
    from tunegrid.track.view import publish_review

    tracking = read_json(args.tracking)
    results = [read_json(path) for path in args.results]
    try:
        review = publish_review(
            tracking_uri_for_cells(tracking), str(tracking["experiment_id"]), results, read_json(args.recommendations)
        )
    except Exception as exc:  # noqa: BLE001 — a store that stays down costs the view and links, never the study
        review = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        print(f"WARNING: MLflow review not written ({review['error']}); the report and the files hold it all")
    write_json(args.out, review)
    if "error" not in review:
        print(f"MLflow review: {review['runs']} current runs described, {review['failing_linked']} failing runs linked")


def plan(args: argparse.Namespace) -> None:
    """plan.csv: the union of the cells' contracts (the `cell_plan` rule's files), one line per cell of the study
    in grid order; nothing is planned here."""
    import pandas as pd

    from tunegrid.contract import CellContract
    from tunegrid.runtime.files import atomic_write_text
    from tunegrid.study.config import expand_cells, resolve_study

    study = resolve_study(read_json(args.study_file))
    rows = []
    for cell in expand_cells(study):
        plan = CellContract.read(Path(args.plans) / f"{cell.cell_id}.json").plan
        rows.append({"cell_id": cell.cell_id, **cell.axes(), **plan.row()})
    frame = pd.DataFrame(rows)
    atomic_write_text(args.out, frame.to_csv(index=False))
    print(frame[["cell_id", "target", "estimate_bytes", "verdict", "reason"]].to_string(index=False))


def cell_plan(args: argparse.Namespace) -> None:
    from tunegrid.cell_spec import CellSpec
    from tunegrid.contract import CellJob
    from tunegrid.prepare.cell_plan import warm_worker_of, write_contract
    from tunegrid.study.config import study_cell_spec

    if args.spec_file:
        spec = CellSpec.from_json(read_json(args.spec_file))
        warm = not (args.cluster or args.no_warm_worker)
    elif args.cell:
        spec = study_cell_spec(args.study_file, args.cell)
        warm = not (args.cluster or args.no_warm_worker) and warm_worker_of(read_json(args.study_file))
    else:
        raise ConfigError("cell-plan --study-file needs --cell (the cell id within the study)")
    job = CellJob(
        model_dir=args.model_dir,
        data_path=args.data,
        run_dir=args.run_dir,
        result_path=args.result or (str(Path(args.run_dir) / "result.json") if args.run_dir else ""),
        capabilities_path=args.capabilities or None,
        tracking_path=args.tracking or None,
        log_path=args.log or None,
        snakemake_job=args.snakemake_job,
    )
    contract = write_contract(spec, job, args.out, warm)
    print(json.dumps(contract.plan.row(), sort_keys=True))


def report(args: argparse.Namespace) -> None:
    from tunegrid.review.report import build_report

    facts = build_report(
        Path(args.summary),
        [Path(p) for p in args.results],
        read_json(args.capabilities),
        read_json(args.environment),
        Path(args.out_dir),
        args.study,
    )
    print(
        f"report {args.out_dir}/index.html: {facts['cells']} cells, {facts['recommendations']} recommendations, "
        f"{facts['outcomes']}"
    )


def execution_end(args: argparse.Namespace) -> None:
    from tunegrid.track.execution import close_execution
    from tunegrid.track.store import tracking_uri_for_cells

    tracking = read_json(args.tracking)
    closed = close_execution(
        tracking_uri_for_cells(tracking),
        tracking["experiment_id"],
        Path(args.study_dir),
        args.status,
        [Path(p) for p in args.attach],
    )
    print("no cell ran in this execution" if closed is None else f"study run {closed['run_id']}: {closed['counts']}")


def screenshots(args: argparse.Namespace) -> None:
    """The report and MLflow's runs and compare pages as PNGs (docs/), through MLflow's own server."""
    from tunegrid.review.study_figures import guide_block, replace_block, study_figures
    from tunegrid.run.ui import compare_page, mlflow_server, rest, runs_page, screenshot
    from tunegrid.runtime.files import write_text_if_changed
    from tunegrid.track.store import tracking_uri_for_cells
    from tunegrid.track.tracking import CELL_TAG

    study_dir, out = Path(args.study_dir), Path(args.out)
    tracking = read_json(study_dir / "tracking.json")
    experiment_id = tracking["experiment_id"]
    recs = read_json(study_dir / "report" / "recommendations.json")
    cells = [cell for rec in recs[:1] for cell in (rec["failing"][:2] + rec["evidence"][:2])]
    wait = {"timeout_s": 600.0}  # a hang guard, not a speed limit: a loaded host draws MLflow's pages slowly
    screenshot((study_dir / "report" / "index.html").resolve().as_uri(), out / "report.png", size=(1400, 2400), **wait)
    with mlflow_server(tracking_uri_for_cells(tracking), **wait) as url:
        runs = rest(url, "runs/search", {"experiment_ids": [experiment_id], "max_results": 1000})["runs"]
        by_cell = {
            tag["value"]: r["info"]["run_id"]
            for r in runs
            for tag in r["data"].get("tags", [])
            if tag["key"] == CELL_TAG
        }
        ids = [by_cell[c] for c in cells if c in by_cell] or [r["info"]["run_id"] for r in runs[:4]]
        screenshot(runs_page(url, experiment_id), out / "mlflow_runs.png", **wait)
        screenshot(compare_page(url, experiment_id, ids), out / "mlflow_compare.png", size=(1600, 1400), **wait)
    # what they show (the host and commit that made them, the figures the guide quotes), so a test can tell when
    # the study has moved on from them; the guide's block of figures is written from the same record
    figures = study_figures(study_dir)
    files = ["report.png", "mlflow_runs.png", "mlflow_compare.png"]
    write_json(out / "screenshots.json", {**figures, "runs": len(runs), "files": files})
    guide = Path(args.guide) if args.guide else out.parent / "guide" / "review.md"
    if guide.is_file():
        write_text_if_changed(guide, replace_block(guide.read_text(), guide_block(figures)))
    made = f"{figures['cells']} cells, {len(runs)} MLflow runs, on a {figures['host']}"
    print(f"screenshots in {out}: {', '.join(files)} ({made})")


def probe_tracking(args: argparse.Namespace) -> None:
    from tunegrid.track.probe_run import log_probe_run
    from tunegrid.track.store import tracking_uri_for_cells

    tracking = read_json(args.tracking)
    run_id = log_probe_run(tracking_uri_for_cells(tracking), tracking["experiment_id"], read_json(args.capabilities))
    write_json(args.out, {"run_id": run_id})
    print(f"probe run {run_id}" if run_id else "probe run not logged (store unreachable); the JSON keeps the record")


def mlflow_ui(args: argparse.Namespace) -> None:
    from tunegrid.run.ui import serve_until_stopped
    from tunegrid.track.store import tracking_uri_for_cells
    from tunegrid.track.view import write_view

    tracking = read_json(args.tracking)
    store = tracking_uri_for_cells(tracking)  # the store the cells wrote: one resolver for all
    log = Path(args.log) if args.log else None
    try:  # the view the printed address opens, from the store as it is now (a store older than the view too)
        write_view(store, str(tracking["experiment_id"]))
    except Exception as exc:  # noqa: BLE001 — the runs are still served, in MLflow's own default view
        print(f"WARNING: could not write the study's view: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    raise SystemExit(
        serve_until_stopped(store, args.host, args.port, args.allowed_hosts, log, str(tracking["experiment_id"]))
    )


def validate(args: argparse.Namespace) -> None:
    from tunegrid.recipes.importer import expand_base
    from tunegrid.study.config import expand_cells, read_study_file, resolve_study

    study = resolve_study(expand_base(read_study_file(args.config)))
    print(f"study {study['study']!r}: {len(expand_cells(study))} cells")
