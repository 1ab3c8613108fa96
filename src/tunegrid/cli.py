"""Command-line entry points the Snakemake rules call; each one can be re-run by hand from its log."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from tunegrid.config import ConfigError
from tunegrid.files import read_json, write_json
from tunegrid.prepare.checkpoints import CheckpointError


def _dataset(args: argparse.Namespace) -> None:
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


def _checkpoint(args: argparse.Namespace) -> None:
    from tunegrid.prepare.checkpoints import produce_checkpoint
    from tunegrid.prepare.data import corpus_texts, read_dataset

    spec = json.loads(args.spec)
    texts = list(corpus_texts(read_dataset(args.data)))
    manifest = produce_checkpoint(spec, texts, Path(args.out))
    print(f"checkpoint {args.out}: {len(manifest['files'])} files, source {manifest['source']['kind']}")


def _environment(args: argparse.Namespace) -> None:
    from tunegrid.prepare.environment import full_env

    env = full_env()
    Path(args.freeze).write_text("\n".join(env["all_packages"]) + "\n")
    write_json(args.out, env)


def _probe(args: argparse.Namespace) -> None:
    from tunegrid.prepare.probes import probe

    record = probe(budget_s=args.budget_s, world_sizes=args.world_sizes)
    write_json(args.out, record)
    print(f"probe: device {record['device']}, precision {record['precision']}, {record['probe_seconds']:.1f} s")


def _tracking_init(args: argparse.Namespace) -> None:
    from tunegrid.track.tracking import init_experiment, redact_uri, resolve_tracking_uri

    uri = resolve_tracking_uri(args.tracking_uri)
    experiment_id = init_experiment(uri, args.experiment, Path(args.artifact_root))
    write_json(
        args.out, {"tracking_uri": redact_uri(uri), "experiment_name": args.experiment, "experiment_id": experiment_id}
    )
    print(f"MLflow experiment {args.experiment!r} (id {experiment_id}) in {redact_uri(uri)}")


def _finetune(args: argparse.Namespace) -> None:
    from tunegrid.config import study_cell_spec
    from tunegrid.run.supervisor import run_cell

    spec = study_cell_spec(args.study_file, args.cell) if args.study_file else json.loads(args.spec)
    result = run_cell(
        spec=spec,
        model_dir=Path(args.model_dir),
        data_path=Path(args.data),
        run_dir=Path(args.run_dir),
        result_path=Path(args.result),
        tracking_path=Path(args.tracking) if args.tracking else None,
        capabilities_path=Path(args.capabilities) if args.capabilities else None,
        log_path=Path(args.log) if args.log else None,
        command=[sys.executable, *sys.argv],
        snakemake_job=args.snakemake_job,
    )
    print(f"cell {spec['cell_id']}: {result['outcome']} — {result['reason']}")


def _worker(args: argparse.Namespace) -> None:
    from tunegrid.cell.train import run_worker

    run_worker(read_json(args.spec), args.model_dir, args.data, args.run_dir)


def _summary(args: argparse.Namespace) -> None:
    from tunegrid.review.summary import write_summary

    frame = write_summary(args.results, args.out, sync_path=args.sync or None)
    print(frame[["cell_id", "outcome", "final_loss", "nan_step", "peak_bytes"]].to_string(index=False))
    print("outcomes:", frame["outcome"].value_counts().to_dict())


def _sync(args: argparse.Namespace) -> None:
    from tunegrid.track.tracking import sync_cell, tracking_uri_for_cells

    tracking = read_json(args.tracking)
    uri = tracking_uri_for_cells(tracking)
    report = {}
    for path in map(Path, args.results):
        result = read_json(path)
        log = Path(args.logs) / f"{result['cell_id']}.log" if args.logs else None
        report[result["cell_id"]] = sync_cell(uri, tracking["experiment_id"], result, path.parent, log)
    write_json(args.out, report)
    created = sum(r["created"] for r in report.values())
    filled = sum(r["points_filled"] for r in report.values())
    failed = [cell for cell, r in report.items() if r["errors"]]
    print(
        f"MLflow sync: {len(report)} cells, {created} runs created, {filled} metric points filled, {len(failed)} failed"
    )


def _plan(args: argparse.Namespace) -> None:
    import pandas as pd

    from tunegrid.config import cell_spec, expand_cells, resolve_study
    from tunegrid.files import atomic_write_text
    from tunegrid.prepare.plan import plan_cell

    study = resolve_study(read_json(args.study_file))
    capabilities = read_json(args.capabilities)
    rows = []
    for cell in expand_cells(study):
        plan = plan_cell(cell_spec(study, cell), Path(args.models) / cell.model, capabilities)
        verdict = plan["verdict"] or ("run", "")
        rows.append(
            {
                "cell_id": cell.cell_id,
                **cell.axes(),
                "target": plan["target"],
                "budget_bytes": plan["budget_bytes"],
                "estimate_bytes": plan["estimate"]["estimate_bytes"],
                "estimate_stage": plan["estimate"]["stage"],
                "verdict": verdict[0],
                "reason": verdict[1],
            }
        )
    frame = pd.DataFrame(rows)
    atomic_write_text(args.out, frame.to_csv(index=False))
    print(frame[["cell_id", "target", "estimate_bytes", "verdict", "reason"]].to_string(index=False))


def _report(args: argparse.Namespace) -> None:
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
        f"report {args.out_dir}/index.html: {facts['cells']} cells, {facts['recommendations']} recommendations, {facts['outcomes']}"
    )


def _execution_end(args: argparse.Namespace) -> None:
    from tunegrid.track.execution import close_execution
    from tunegrid.track.tracking import tracking_uri_for_cells

    tracking = read_json(args.tracking)
    closed = close_execution(
        tracking_uri_for_cells(tracking),
        tracking["experiment_id"],
        Path(args.study_dir),
        args.status,
        [Path(p) for p in args.attach],
    )
    print("no cell ran in this execution" if closed is None else f"study run {closed['run_id']}: {closed['counts']}")


def _screenshots(args: argparse.Namespace) -> None:
    """The report and MLflow's runs and compare pages as PNGs (docs/), through MLflow's own server."""
    from tunegrid.run.ui import compare_page, mlflow_server, rest, runs_page, screenshot
    from tunegrid.track.tracking import tracking_uri_for_cells

    study_dir, out = Path(args.study_dir), Path(args.out)
    tracking = read_json(study_dir / "tracking.json")
    experiment_id = tracking["experiment_id"]
    recs = read_json(study_dir / "report" / "recommendations.json")
    cells = [cell for rec in recs[:1] for cell in (rec["failing"][:2] + rec["evidence"][:2])]
    screenshot((study_dir / "report" / "index.html").resolve().as_uri(), out / "report.png", size=(1400, 2400))
    with mlflow_server(tracking_uri_for_cells(tracking)) as url:
        runs = rest(url, "runs/search", {"experiment_ids": [experiment_id], "max_results": 1000})["runs"]
        by_name = {r["info"]["run_name"]: r["info"]["run_id"] for r in runs}
        ids = [by_name[c] for c in cells if c in by_name] or [r["info"]["run_id"] for r in runs[:4]]
        screenshot(runs_page(url, experiment_id), out / "mlflow_runs.png")
        screenshot(compare_page(url, experiment_id, ids), out / "mlflow_compare.png", size=(1600, 1400))
    print(f"screenshots in {out}: report.png, mlflow_runs.png, mlflow_compare.png")


def _probe_tracking(args: argparse.Namespace) -> None:
    from tunegrid.track.tracking import log_probe_run, tracking_uri_for_cells

    tracking = read_json(args.tracking)
    run_id = log_probe_run(tracking_uri_for_cells(tracking), tracking["experiment_id"], read_json(args.capabilities))
    write_json(args.out, {"run_id": run_id})
    print(f"probe run {run_id}" if run_id else "probe run not logged (store unreachable); the JSON keeps the record")


def _mlflow_ui(args: argparse.Namespace) -> None:
    from tunegrid.run.ui import serve_until_stopped
    from tunegrid.track.tracking import tracking_uri_for_cells

    store = tracking_uri_for_cells(read_json(args.tracking))  # the store the cells wrote: one resolver for all
    raise SystemExit(
        serve_until_stopped(store, args.host, args.port, args.allowed_hosts, Path(args.log) if args.log else None)
    )


def _validate(args: argparse.Namespace) -> None:
    from tunegrid.config import expand_cells, load_study

    study = load_study(args.config)
    print(f"study {study['study']!r}: {len(expand_cells(study))} cells")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tunegrid", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("dataset", help="write the training records (generated, or the study's own data)")
    p.add_argument("--data-spec", help="the study's data section as JSON (default: generated pairs)")
    p.add_argument("--examples", type=int, help="(synthetic) generated pairs")
    p.add_argument("--seed", type=int, help="(synthetic) generator seed")
    p.add_argument("--out", required=True)
    p.set_defaults(func=_dataset)

    p = sub.add_parser("checkpoint", help="produce a model folder (hub, local or synthetic)")
    p.add_argument("--spec", required=True, help="the model's config entry as JSON")
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.set_defaults(func=_checkpoint)

    p = sub.add_parser("environment", help="record the software environment")
    p.add_argument("--out", required=True)
    p.add_argument("--freeze", required=True)
    p.set_defaults(func=_environment)

    p = sub.add_parser("probe", help="record hardware capabilities")
    p.add_argument("--out", required=True)
    p.add_argument("--budget-s", type=float, default=30.0)
    p.add_argument("--world-sizes", type=int, nargs="*", default=[2])
    p.set_defaults(func=_probe)

    p = sub.add_parser("tracking-init", help="create the MLflow store and the study's experiment once")
    p.add_argument("--tracking-uri", default="")
    p.add_argument("--experiment", required=True)
    p.add_argument("--artifact-root", required=True)
    p.add_argument("--out", required=True)
    p.set_defaults(func=_tracking_init)

    p = sub.add_parser("finetune", help="run one grid cell under supervision; always writes result.json")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--study-file", help="the resolved study (results/<study>/study.json); with --cell")
    source.add_argument("--spec", help="the cell's resolved spec as JSON (by hand; the workflow passes a file)")
    p.add_argument("--cell", default="", help="the cell id within --study-file")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--tracking", default="", help="tracking.json from tracking-init; empty: no MLflow")
    p.add_argument("--capabilities", default="", help="the probe's capabilities.json (target, budget, estimate)")
    p.add_argument("--log", default="", help="the rule's log, attached to the MLflow run")
    p.add_argument("--snakemake-job", default="", help="rule and job id, recorded as a run tag")
    p.set_defaults(func=_finetune)

    p = sub.add_parser("worker", help="(internal) the training process a finetune job supervises")
    p.add_argument("--spec", required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--run-dir", required=True)
    p.set_defaults(func=_worker)

    p = sub.add_parser("summary", help="one row per cell as CSV")
    p.add_argument("--out", required=True)
    p.add_argument("--sync", default="", help="tracking-sync.json: run ids of runs created after the fact")
    p.add_argument("results", nargs="+")
    p.set_defaults(func=_summary)

    p = sub.add_parser("sync", help="fill MLflow from the result files (runs whose store was down)")
    p.add_argument("--tracking", required=True)
    p.add_argument("--logs", default="", help="folder of the cells' rule logs, attached to created runs")
    p.add_argument("--out", required=True)
    p.add_argument("results", nargs="+")
    p.set_defaults(func=_sync)

    p = sub.add_parser("plan", help="before training: per cell, the target, the memory estimate and the verdict")
    p.add_argument("--study-file", required=True, help="the resolved study (results/<study>/study.json)")
    p.add_argument("--capabilities", required=True)
    p.add_argument("--models", required=True, help="folder of the study's checkpoints")
    p.add_argument("--out", required=True)
    p.set_defaults(func=_plan)

    p = sub.add_parser("report", help="the comparison report: HTML, PNGs and recommendations")
    p.add_argument("--summary", required=True, help="summary.parquet")
    p.add_argument("--capabilities", required=True)
    p.add_argument("--environment", required=True)
    p.add_argument("--study", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("results", nargs="+")
    p.set_defaults(func=_report)

    p = sub.add_parser("execution-end", help="(Snakefile hook) close this execution's parent MLflow run")
    p.add_argument("--tracking", required=True)
    p.add_argument("--study-dir", required=True)
    p.add_argument("--status", choices=["FINISHED", "FAILED", "KILLED"], required=True)
    p.add_argument("--attach", nargs="*", default=[])
    p.set_defaults(func=_execution_end)

    p = sub.add_parser("screenshots", help="PNGs of the report and of the MLflow UI (runs, compare) for docs/")
    p.add_argument("--study-dir", required=True, help="results/<study> of a finished study")
    p.add_argument("--out", required=True)
    p.set_defaults(func=_screenshots)

    p = sub.add_parser("probe-tracking", help="log the probe's record as an MLflow run")
    p.add_argument("--tracking", required=True)
    p.add_argument("--capabilities", required=True)
    p.add_argument("--out", required=True)
    p.set_defaults(func=_probe_tracking)

    p = sub.add_parser("mlflow-ui", help="MLflow's own server on the study's store until Ctrl-C")
    p.add_argument("--tracking", required=True, help="the study's tracking.json (names the store)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--allowed-hosts", default="")
    p.add_argument("--log", default="")
    p.set_defaults(func=_mlflow_ui)

    p = sub.add_parser("validate", help="check a study config and count its cells")
    p.add_argument("config")
    p.set_defaults(func=_validate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ConfigError, CheckpointError) as exc:
        print(f"tunegrid {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 0


def run() -> None:
    """Process entry point (scripts/tunegrid.py, `python -m tunegrid.cli`, the `tunegrid` command).

    A command that returns leaves by os._exit: the interpreter's teardown of torch, transformers and
    mlflow costs 0.6-1.3 s per process here (benchmarks/orchestration.py) and does nothing for us, since
    every file is written atomically or line-flushed before return (crash-safe writers never rely on
    teardown) and every child process has been waited for. An exception still exits the normal way, with
    its traceback. Tests call main() in-process, which is unaffected."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
