"""`tunegrid doctor <recipe or study>`: one failing run in, the proven fix out (tunegrid.run.doctor_workflow runs
the Snakemake target), and the commands the doctor's rules call between its waves (workflow/rules/doctor.smk)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tunegrid.runtime.files import read_json, write_json
from tunegrid.study.paths import StudyPaths
from tunegrid.targets import TARGETS

MODES = ("all", "first")
TARGET_NAMES = ("native", *TARGETS)  # the schema's hardware.target


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="reproduce one failing recipe or study cell, then prove its fix in few cells")
    p.add_argument("source", help="a study YAML, or an axolotl / TRL / Transformers recipe")
    p.add_argument("--cell", default="", help="the study's failing cell (default: the first value of every axis)")
    p.add_argument("--first", action="store_true", help="stop at the first fix that holds parity")
    p.add_argument("--steps", type=int, default=0, help="steps per cell: the budget to meet the failure")
    p.add_argument("--cores", type=int, default=2, help="snakemake --cores")
    p.add_argument(
        "--snakemake",
        default="",
        help="more snakemake arguments, e.g. '--profile slurm' (the profile in this repository's slurm/)",
    )
    p.add_argument(
        "--target",
        default="",
        choices=["", *TARGET_NAMES],
        help="the card the fix is for (hardware.target; a recipe names none): its memory, its precisions, and the "
        "fixes ranked by the cost modelled from its data sheet",
    )
    p.add_argument("--from", dest="tool", default="auto", choices=["auto", "axolotl", "trl", "transformers"])
    p.add_argument("--ignore", nargs="*", default=[], help="(recipe) keys tunegrid cannot honour, to drop")
    p.add_argument("--model", default="", help="(recipe) when it names none: a folder or <hub id>@<revision>")
    p.add_argument("--dataset", default="", help="(recipe) when it names none: a jsonl/parquet file")
    p.add_argument("--study-out", default="", help="(recipe) where to write its study (default results/doctor/)")
    p.set_defaults(func=doctor)

    p = sub.add_parser("doctor-reproduce", help="(doctor rule) did the baseline fail; which repeat to run")
    p.add_argument("--baseline", required=True, help="the baseline cell's result.json")
    p.add_argument("--out", required=True)
    p.set_defaults(func=doctor_reproduce)

    p = sub.add_parser("doctor-diagnose", help="(doctor rule) deterministic or transient; the second wave")
    p.add_argument("--study-file", required=True)
    p.add_argument("--baseline", required=True, help="the baseline cell's result.json")
    p.add_argument("--repeat", default="", help="its same-seed re-run's result.json")
    p.add_argument("--capabilities", required=True)
    p.add_argument("--out", required=True)
    p.add_argument(
        "plans",
        nargs="*",
        help="the cells' contracts (their plans) an out-of-memory choice, or one on a named target, reads",
    )
    p.set_defaults(func=doctor_diagnose)

    p = sub.add_parser("doctor-try", help="(doctor rule) does a fix of the baseline hold among the cells so far")
    p.add_argument("--study-file", required=True)
    p.add_argument("--diagnosis", required=True)
    p.add_argument("--mode", required=True, choices=MODES)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--capabilities", required=True)
    p.add_argument("--out", required=True)
    p.set_defaults(func=doctor_try)

    p = sub.add_parser("doctor-verdict", help="(doctor rule) the doctor's answer, summary and report")
    p.add_argument("--study-file", required=True)
    p.add_argument("--diagnosis", required=True)
    p.add_argument("--mode", required=True, choices=MODES)
    p.add_argument("--capabilities", required=True)
    p.add_argument("--environment", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("tries", nargs="*", help="the try files run, in order")
    p.set_defaults(func=doctor_verdict)


def _paths(study_file: str) -> StudyPaths:
    """The study's paths from its study.json (results/<study>/study.json)."""
    study_dir = Path(study_file).parent
    return StudyPaths(study_dir.parent, study_dir.name)


def doctor(args: argparse.Namespace) -> None:
    from tunegrid.run.doctor_workflow import run_doctor

    raise SystemExit(run_doctor(args))


def doctor_reproduce(args: argparse.Namespace) -> None:
    from tunegrid.review.doctor_choice import repeat_of, result_row
    from tunegrid.study.config import Cell
    from tunegrid.vocabulary import Outcome, parse_cell_id

    row = result_row(args.baseline)
    failed = row["outcome"] != Outcome.OK
    repeat = repeat_of(Cell(**parse_cell_id(row["cell_id"]))).cell_id if failed else ""
    write_json(args.out, {"baseline": row["cell_id"], "outcome": row["outcome"], "repeat_cell": repeat})
    print(f"{row['cell_id']}: {row['outcome']}" + (f"; its same-seed re-run: {repeat}" if repeat else ""))


def doctor_diagnose(args: argparse.Namespace) -> None:
    from tunegrid.contract import CellContract
    from tunegrid.review.doctor_choice import DETERMINISTIC, Choice, choose, reproduction, result_row
    from tunegrid.study.config import Cell, resolve_study
    from tunegrid.vocabulary import parse_cell_id

    study = resolve_study(read_json(args.study_file))
    base = result_row(args.baseline)
    reproduced = reproduction(base, result_row(args.repeat) if args.repeat else None)
    reproduced["baseline_cell"] = base["cell_id"]
    reproduced["repeat_cell"] = result_row(args.repeat)["cell_id"] if args.repeat else ""
    if reproduced["verdict"] == DETERMINISTIC:
        capabilities = read_json(args.capabilities)
        contracts = [CellContract.read(p) for p in args.plans]
        plans = {contract.cell_id: _plan_row(contract, capabilities) for contract in contracts}
        baseline = Cell(**parse_cell_id(base["cell_id"]))
        choice = choose(study, baseline, base, capabilities, plans)
    else:
        choice = Choice(base["outcome"], skipped=[f"{reproduced['verdict']}: no second wave"])
    write_json(args.out, {"reproduction": reproduced, "choice": choice.as_dict()})
    print(f"{base['cell_id']}: {reproduced['verdict']}; candidates {[c.cell_id for c in choice.candidates]}")
    for skipped in choice.skipped:
        print(f"  skipped {skipped}")


def _plan_row(contract: Any, capabilities: dict[str, Any]) -> dict[str, Any]:
    """A contract's plan.csv row with its step time modelled on its named target (None on the machine itself), and
    the most tokens/s it could reach on this machine: its tokens per step over its step's floor
    (tunegrid.prepare.liveness.step_floor_s), the bound the doctor stops by where fixes rank by throughput."""
    from tunegrid.prepare.liveness import step_floor_s
    from tunegrid.targets import modelled_step_s

    plan, axes = contract.plan, contract.spec.axes
    precision = str(axes.precision)
    checkpointing = bool(axes.activation_checkpointing)
    step = modelled_step_s(
        plan.target,
        precision,
        plan.liveness.step_flops,
        plan.estimate().components.as_dict(),
        checkpointing=checkpointing,
    )
    floor = step_floor_s(plan.liveness.step_flops, precision, checkpointing, capabilities)
    tokens = axes.batch_size * axes.grad_accum * contract.spec.train.seq_len
    ceiling = {"ceiling_tokens_per_s": tokens / floor[0], "ceiling_basis": floor[1]} if floor and floor[0] > 0 else {}
    return {**plan.row(), "modelled_step_s": step, **ceiling}


def _cells_before(diagnosis: dict, index: int, passed: list[str]) -> list[str]:
    """The baseline, its repeat and every try's cells up to `index`, in order."""
    from tunegrid.review.doctor_choice import tries

    reproduced = diagnosis["reproduction"]
    cells = [c for c in (reproduced["baseline_cell"], reproduced["repeat_cell"]) if c]
    for group in tries(diagnosis["choice"], passed)[: index + 1]:
        cells += [c for c in group if c not in cells]
    return cells


def doctor_try(args: argparse.Namespace) -> None:
    from tunegrid.review.doctor_choice import tries
    from tunegrid.review.doctor_verdict import try_verdict
    from tunegrid.study.config import resolve_study

    study = resolve_study(read_json(args.study_file))
    diagnosis = read_json(args.diagnosis)
    paths = _paths(args.study_file)
    baseline = diagnosis["reproduction"]["baseline_cell"]
    # the candidates the try before this one passed over (an input of this rule: common.smk's get_doctor_try_cells)
    before = paths.doctor_try(baseline, args.mode, args.index - 1) if args.index else None
    passed = read_json(before).get("passed", []) if before else []
    cells = _cells_before(diagnosis, args.index, passed)
    new = tries(diagnosis["choice"], passed)[args.index]
    record = try_verdict(
        paths,
        study,
        baseline,
        cells,
        new,
        read_json(args.capabilities),
        Path(args.out),
        diagnosis["choice"],
        args.mode == "first",
    )
    held = "a fix holds" if record["holds"] else "no fix holds yet"
    print(f"try {args.index} ({', '.join(new)}): {held}" + ("; the second wave stops here" if record["stop"] else ""))
    for line in record["not_run"]:
        print(f"  not run: {line}")


def doctor_verdict(args: argparse.Namespace) -> None:
    from tunegrid.review.doctor_verdict import conclude
    from tunegrid.study.config import resolve_study

    study = resolve_study(read_json(args.study_file))
    diagnosis = read_json(args.diagnosis)
    records = [read_json(p) for p in args.tries]
    tried = [r["new"] for r in records]
    record = conclude(
        _paths(args.study_file),
        study,
        diagnosis["reproduction"]["baseline_cell"],
        args.mode,
        diagnosis["reproduction"],
        diagnosis["choice"],
        tried,
        read_json(args.capabilities),
        read_json(args.environment),
        Path(args.out_dir),
        records[-1].get("not_run") if records else None,
    )
    print("\n".join(record["screen"]))
    print(json.dumps({"answer": record["answer"], "cell_minutes": record["cell_minutes"]}))
