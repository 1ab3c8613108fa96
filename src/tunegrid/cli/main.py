"""Command-line entry points the Snakemake rules call; each one can be re-run by hand from its log.
The parser and dispatch are here; what each command does is tunegrid.cli.commands.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import tunegrid.cli.commands as commands
import tunegrid.cli.doctor as doctor
import tunegrid.cli.pin as pin
import tunegrid.cli.recipes as recipes
from tunegrid.prepare.checkpoints import CheckpointError
from tunegrid.study.config import ConfigError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tunegrid", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_preparation_parsers, _cell_parsers, _record_parsers, _contract_parsers, _review_parsers):
        add(sub)  # in this order: the reference pages list the commands as the parser holds them
    recipes.add_parsers(sub)
    doctor.add_parsers(sub)
    pin.add_parser(sub)
    return parser


def _preparation_parsers(sub: Any) -> None:
    """The study's inputs: data set, checkpoints, environments, stacks, probe, tracking store."""
    p = sub.add_parser("dataset", help="write the training records (generated, or the study's own data)")
    p.add_argument("--data-spec", help="the study's data section as JSON (default: generated pairs)")
    p.add_argument("--examples", type=int, help="(synthetic) generated pairs")
    p.add_argument("--seed", type=int, help="(synthetic) generator seed")
    p.add_argument("--out", required=True)
    p.set_defaults(func=commands.dataset)

    p = sub.add_parser("checkpoint", help="produce a model folder (hub, local, synthetic or gguf)")
    p.add_argument("--spec", required=True, help="the model's config entry as JSON")
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.set_defaults(func=commands.checkpoint)

    p = sub.add_parser("environment", help="record the software environment")
    p.add_argument("--out", required=True)
    p.add_argument("--freeze", required=True)
    p.set_defaults(func=commands.environment)

    p = sub.add_parser("stack", help="build (or reuse) a library stack's environment; record its versions")
    p.add_argument("--name", required=True)
    p.add_argument("--pins", required=True, help='JSON: {"package": "version specifier"}')
    p.add_argument("--results", default="results", help="the results folder: stacks are cached under <it>/stacks/")
    p.add_argument("--record", required=True)
    p.add_argument("--freeze", required=True)
    p.set_defaults(func=commands.stack)

    p = sub.add_parser("probe", help="record hardware capabilities")
    p.add_argument("--out", required=True)
    p.add_argument("--budget-s", type=float, default=30.0)
    p.add_argument("--world-sizes", type=int, nargs="*", default=[], help="ranks of the all-reduce benchmark")
    p.set_defaults(func=commands.probe)

    p = sub.add_parser("tracking-init", help="create the MLflow store and the study's experiment once")
    p.add_argument("--tracking-uri", default="")
    p.add_argument("--experiment", required=True)
    p.add_argument("--artifact-root", required=True)
    p.add_argument("--system-metrics-interval-s", type=float, default=0.0, help="MLflow's system metrics; 0: off")
    p.add_argument("--out", required=True)
    p.set_defaults(func=commands.tracking_init)


def _cell_parsers(sub: Any) -> None:
    """A cell's job and the training process it supervises."""
    p = sub.add_parser("finetune", help="run one grid cell under supervision; always writes result.json")
    p.add_argument("--contract", required=True, help="the cell's contract (results/<study>/plans/<cell_id>.json)")
    p.set_defaults(func=commands.finetune)

    p = sub.add_parser("worker", help="(internal) the training process a finetune job supervises")
    p.add_argument("--contract", required=True)
    p.set_defaults(func=commands.worker)


def _record_parsers(sub: Any) -> None:
    """What the cells leave, gathered: the summary, MLflow filled after the fact, the runs page."""
    p = sub.add_parser("summary", help="one row per cell as CSV")
    p.add_argument("--out", required=True)
    p.add_argument("--sync", default="", help="tracking-sync.json: run ids of runs created after the fact")
    p.add_argument("--review", default="", help="the study's review settings as JSON (reference, loss_tolerance, …)")
    p.add_argument("results", nargs="+")
    p.set_defaults(func=commands.summary)

    p = sub.add_parser("sync", help="fill MLflow from the result files (runs whose store was down)")
    p.add_argument("--tracking", required=True)
    p.add_argument("--logs", default="", help="folder of the cells' rule logs, attached to created runs")
    p.add_argument("--out", required=True)
    p.add_argument("results", nargs="+")
    p.set_defaults(func=commands.sync)

    p = sub.add_parser("mlflow-review", help="the study's runs page as a comparison table, failures linked to fixes")
    p.add_argument("--tracking", required=True)
    p.add_argument("--recommendations", required=True, help="the report's recommendations.json")
    p.add_argument("--out", required=True)
    p.add_argument("results", nargs="+")
    p.set_defaults(func=commands.mlflow_review)


def _contract_parsers(sub: Any) -> None:
    """The cells' contracts and the study's plan table."""
    p = sub.add_parser("plan", help="plan.csv: per cell, the target, the memory estimate and the verdict")
    p.add_argument("--study-file", required=True, help="the resolved study (results/<study>/study.json)")
    p.add_argument("--plans", required=True, help="the folder of the cells' contracts (results/<study>/plans)")
    p.add_argument("--out", required=True)
    p.set_defaults(func=commands.plan)

    p = sub.add_parser("cell-plan", help="one cell's contract: its spec, its plan and its job's files, as JSON")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--spec-file", help="the cell's resolved spec (results/<study>/specs/<cell_id>.json)")
    source.add_argument("--study-file", help="the resolved study (results/<study>/study.json); with --cell")
    p.add_argument("--cell", default="", help="the cell id within --study-file")
    p.add_argument("--capabilities", default="", help="the probe's capabilities.json (target, budget, constants)")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--data", default="", help="the study's data set the cell trains on")
    p.add_argument("--run-dir", default="", help="the cell's run folder")
    p.add_argument("--result", default="", help="its result.json (default: in the run folder)")
    p.add_argument("--tracking", default="", help="tracking.json from tracking-init; empty: no MLflow")
    p.add_argument("--log", default="", help="the finetune job's log, attached to the MLflow run")
    p.add_argument("--snakemake-job", default="", help="rule and output of the finetune job, recorded as a run tag")
    p.add_argument("--out", required=True)
    p.add_argument(
        "--cluster", action="store_true", help="the cells run as cluster jobs (spawned workers, never forked)"
    )
    p.add_argument("--no-warm-worker", action="store_true", help="the run keeps no warm worker (all spawned)")
    p.set_defaults(func=commands.cell_plan)


def _review_parsers(sub: Any) -> None:
    """The report and its views: HTML, screenshots, the MLflow UI, the study's check."""
    p = sub.add_parser("report", help="the comparison report: HTML, PNGs and recommendations")
    p.add_argument("--summary", required=True, help="summary.parquet")
    p.add_argument("--capabilities", required=True)
    p.add_argument("--environment", required=True)
    p.add_argument("--study", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("results", nargs="+")
    p.set_defaults(func=commands.report)

    p = sub.add_parser("execution-end", help="(Snakefile hook) close this execution's parent MLflow run")
    p.add_argument("--tracking", required=True)
    p.add_argument("--study-dir", required=True)
    p.add_argument("--status", choices=["FINISHED", "FAILED", "KILLED"], required=True)
    p.add_argument("--attach", nargs="*", default=[])
    p.set_defaults(func=commands.execution_end)

    p = sub.add_parser("screenshots", help="PNGs of the report and of the MLflow UI (runs, compare) for docs/")
    p.add_argument("--study-dir", required=True, help="results/<study> of a finished study")
    p.add_argument("--out", required=True)
    p.add_argument(
        "--guide", help="the review guide whose block of figures to rewrite (default: <out>/../guide/review.md)"
    )
    p.set_defaults(func=commands.screenshots)

    p = sub.add_parser("probe-tracking", help="log the probe's record as an MLflow run")
    p.add_argument("--tracking", required=True)
    p.add_argument("--capabilities", required=True)
    p.add_argument("--out", required=True)
    p.set_defaults(func=commands.probe_tracking)

    p = sub.add_parser("mlflow-ui", help="MLflow's own server on the study's store until Ctrl-C")
    p.add_argument("--tracking", required=True, help="the study's tracking.json (names the store)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--allowed-hosts", default="")
    p.add_argument("--log", default="")
    p.set_defaults(func=commands.mlflow_ui)

    p = sub.add_parser("validate", help="check a study config and count its cells")
    p.add_argument("config")
    p.set_defaults(func=commands.validate)


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
    its traceback. Tests call main() in-process, which is unaffected. A command the invocation's warm supervisor
    serves is forked by it (tunegrid.run.warm_jobs): this process then only waits and relays."""
    from tunegrid.run.warm_jobs import forked_job
    from tunegrid.runtime.telemetry import telemetry_off

    telemetry_off()  # before anything imports MLflow or the hub (tunegrid.runtime.telemetry says why)
    forked = forked_job(sys.argv)
    code = main() if forked is None else forked
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
