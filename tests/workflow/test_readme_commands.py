"""Every command README.md and the docs site (docs/**/*.md) show, exercised as written.

The commands are read from the pages (fenced blocks and inline code that starts like a shell command), so
the two cannot drift: a command added to a page without an entry in `HOW` below fails the first test.
Each entry says how the command is exercised:

- `run`: exactly as written, in a fresh clone of this checkout whose default study has run (the
  README's main command, minus its install steps: this interpreter already has the pinned packages);
- `each`: as written, from the repository root, with `<study>` replaced by every shipped study (commands
  that write nothing);
- `dry`: as written plus `-n` (Snakemake resolves the study, the DAG and every input, trains nothing);
  `<study>` is replaced by every shipped study;
- `server`: started as written, answered over HTTP on 127.0.0.1, then stopped with Ctrl-C (SIGINT);
- `elsewhere`: run as written by another test or by CI, named in the reason;
- `cannot`: needs what no test here can have (a package index on the network, a GPU, a secret);
- `name`: prose that names a command (or its form) rather than one to type; the forms a page shows in full
  are entries of their own.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import DEFAULT_STUDY_COMMAND, REPO, shell, shell_env

STARTS = ("snakemake", "python", "python3", "pip", "export", "bash", ". .venv", "tunegrid ", "mkdocs")
OUTPUT = {"text", "diff", "yaml", "python", "json"}  # fenced blocks that hold no command
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
STUDIES = sorted(p.stem for p in (REPO / "configs").glob("*.yaml"))
INSTALL = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install -r envs/requirements.txt && "
    "pip install --no-deps -e . && "
)
HOW_MAIN = "snakemake --cores 8 all"  # the main command after its install steps
RECIPES = "tests/workflow/test_recipes_e2e.py runs README's recipe block in order, as written, in a fresh copy"

HOW: dict[str, tuple[str, str]] = {
    INSTALL + "snakemake --cores 8 all": (
        "run",
        "the main job: `snakemake --cores 8 all` as written, after the install",
    ),
    "python3 -m venv .venv && . .venv/bin/activate && pip install -r envs/requirements-test.txt && "
    "pip install --no-deps -r envs/requirements-real.txt && pip install --no-deps -e . && python -m pytest": (
        "elsewhere",
        ".ci/run reads this line from README and runs it on a clean clone",
    ),
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu": (
        "cannot",
        "needs the PyTorch package index on the network",
    ),
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128": (
        "cannot",
        "needs the PyTorch package index and a GPU",
    ),
    "python3 -m venv .venv && . .venv/bin/activate": (
        "elsewhere",
        "the first part of the main command (.ci/run runs it too)",
    ),
    "pip install --no-deps -r envs/requirements-real.txt": (
        "elsewhere",
        "part of README's test command, which .ci/run runs on a clean clone",
    ),
    "pip install -r envs/requirements.txt && pip install --no-deps -e .": (
        "elsewhere",
        "the install part of the main command",
    ),
    "snakemake --cores 8 all": ("run", "the main job"),
    "snakemake --report results/<study>/report.html": ("run", "Snakemake's own report of the default study"),
    "python scripts/tunegrid.py screenshots --study-dir results/default --out docs/screenshots": (
        "run",
        "headless Chromium",
    ),
    "snakemake --cores 1 mlflow_ui": ("server", "MLflow's UI on 127.0.0.1:5000"),
    "snakemake --cores 8 all --config study=configs/<study>.yaml": ("dry", "every shipped study"),
    'snakemake --cores 8 all --config "train={steps: 20, gradient_checkpointing: true}" "grid={batch_size: [2]}"': (
        "dry",
        "typed overrides",
    ),
    "python benchmarks/memory_estimate.py": ("run", "re-estimates the default study's ok cells"),
    "snakemake --cores 8 plan": ("run", "the plan before training"),
    "snakemake --unlock": ("run", "recovery after a kill"),
    "snakemake --profile slurm --config study=configs/<study>.yaml": (
        "elsewhere",
        "tests/workflow/test_slurm.py runs `--profile slurm` on a real one-node SLURM",
    ),
    "snakemake all --cores 8 --resources gpu=1": ("dry", "the GPU form of the main job"),
    "export HF_TOKEN=…": ("cannot", "sets a secret for the hub"),
    "snakemake all --cores 8 --config study=configs/gemma3-4b-t4.yaml --resources gpu=1": (
        "dry",
        "hub study: trains only with the hub and a GPU",
    ),
    "snakemake all --cores 8 --config study=configs/gemma3-4b-t4-synthetic.yaml --resources gpu=1": (
        "dry",
        "trains on a GPU (tests/workflow/test_gpu.py)",
    ),
    "snakemake all --cores 8 --config study=configs/moe-qlora-memory.yaml --resources gpu=1": (
        "dry",
        "hub study: trains only with the hub and a GPU",
    ),
    "snakemake all --cores 8 --config study=configs/moe-qlora-memory-synthetic.yaml --resources gpu=1": (
        "dry",
        "trains on a GPU (tests/workflow/test_gpu.py)",
    ),
    "snakemake --cores 2 all --config study=configs/moe-oom-at-load.yaml": (
        "dry",
        "5 min on a 2-core CPU; tests/study/test_studies.py runs it at reduced size end to end",
    ),
    "snakemake all --cores 8 --config study=configs/collective-timeout.yaml --resources gpu=2": (
        "dry",
        "needs 2 GPUs to train; its CPU form, configs/collective-timeout-cpu.yaml, runs in "
        "tests/workflow/test_collective_study.py",
    ),
    "python benchmarks/memory_fixes.py": (
        "elsewhere",
        "trains configs/memory-fixes-cpu.yaml (minutes on 2 cores); what it compares is checked by "
        "tests/cell/test_optimizers.py",
    ),
    "python benchmarks/cpu_memory_evidence.py": (
        "elsewhere",
        "records whole default-study runs (minutes); tests/prepare/test_cpu_memory_evidence.py replays what it "
        "recorded (tests/data/evidence-cpu-default-study.json)",
    ),
    "snakemake --cores 8 all --config study=configs/gemma3-270m-cpu.yaml": (
        "elsewhere",
        "tests/workflow/test_real_weights.py runs the study through Snakemake, trimmed to the cells that carry its "
        "claims (the whole study takes minutes of fp16 on a CPU)",
    ),
    "snakemake --cores 2 all --config study=configs/memory-fixes-oom-cpu.yaml": (
        "elsewhere",
        "tests/workflow/test_memory_fixes_oom.py runs it as written, with --cores 2",
    ),
    "python benchmarks/nan_overhead.py": (
        "elsewhere",
        "a benchmark of minutes; its `--smoke` form (the same code at tiny sizes) runs in the GPU acceptance's CPU "
        "mode, tests/workflow/test_gpu_acceptance.py",
    ),
    "python -m pytest": ("elsewhere", ".ci/run"),
    "python -m pytest -m 'not slow'": ("elsewhere", "a subset of what .ci/run runs"),
    "python -m pytest -m gpu": ("cannot", "needs a CUDA device (tests/workflow/test_gpu.py skips without one)"),
    "mkdocs build --strict": (
        "elsewhere",
        "tests/house/test_docs.py runs it as written with --site-dir in a temporary folder",
    ),
    "tunegrid validate configs/config.yaml": ("each", "validates the default study"),
    "tunegrid validate configs/<study>.yaml": ("each", "every shipped study"),
    "tunegrid validate their-study.yaml": (
        "elsewhere",
        "tests/study/test_hostile_studies.py validates generated hostile study files",
    ),
    "snakemake --cores 8 --resources gpu=1 all": (
        "name",
        "findings.md shows it as the pitfall (--resources reads `all` as a resource); the form that works, "
        "`snakemake all --cores 8 --resources gpu=1`, is a dry entry",
    ),
    "snakemake --cores 1 -n --configfile merge.yaml": (
        "elsewhere",
        "the upstream report's merge-key bomb: tests/study/test_hostile_studies.py runs Snakemake's loader on it",
    ),
    "snakemake --cores 1 -n --configfile mapping.yaml": (
        "elsewhere",
        "the upstream report's mapping bomb: tests/study/test_hostile_studies.py runs Snakemake's loader on it",
    ),
    "tunegrid import": ("name", "its full forms are the recipe page's commands"),
    "tunegrid pin": ("name", "its full form is the entry below"),
    "tunegrid pin configs/<study>.yaml": ("cannot", "asks the hub for the commits of unpinned ids (network)"),
    "tunegrid import <recipe>": ("name", "the form of import; the recipe page's commands run it"),
    "tunegrid export <cell> --to axolotl|trl": ("name", "the form of export; the recipe page's commands run it"),
    "python benchmarks/recipe_import.py <folder>...": (
        "cannot",
        "needs a folder of real-world recipes this checkout does not ship; tests/recipes/test_recipes.py imports "
        "the held-out ones it does",
    ),
    "snakemake --cores 8 all --config study=configs/memory-fixes-oom-cpu.yaml": ("dry", "the out-of-memory study"),
    'snakemake --cores 8 all --config study=configs/<study>.yaml "train={steps: 20}" "grid={batch_size: [2]}"': (
        "dry",
        "every shipped study, with typed overrides on top",
    ),
    "tunegrid export": ("name", "its full forms are the recipe page's commands"),
    "tunegrid validate": ("name", "its full forms are entries above"),
    "tunegrid finetune --contract": ("name", "the finetune rule's shell line: every study run in this file runs it"),
    "tunegrid export <cell_id> --to axolotl|trl": ("name", "the form of export; the recipe page's commands run it"),
    "python scripts/tunegrid.py": ("name", "the entry point; every full command of it is an entry"),
    "python scripts/tunegrid.py screenshots": (
        "name",
        "named by the review guide's generated block as what writes it; its full form is an entry above",
    ),
    "python -m tunegrid.cli": ("name", "the same entry point as a module"),
    "snakemake --configfile": ("name", "the option the upstream report is about"),
    "snakemake -n": ("name", "a dry run, as findings.md measured it; every dry entry runs one"),
    "python -X importtime": ("name", "Python's import profiler, named as the tool a finding used"),
    "snakemake --lint": ("run", "Snakemake's linter on the workflow"),
    "snakemake --cores 8 all --config study=configs/own-data-chat.yaml": (
        "run",
        "the shipped chat JSONL, packed, end to end",
    ),
    "python scripts/make_example_model.py": ("elsewhere", RECIPES),
    "python scripts/tunegrid.py import examples/axolotl-gemma3-tiny.yaml --failure nan "
    "--out examples/axolotl-gemma3-tiny.study.yaml": ("elsewhere", RECIPES),
    "snakemake --cores 8 all --config study=examples/axolotl-gemma3-tiny.study.yaml": ("elsewhere", RECIPES),
    "python scripts/tunegrid.py export recommended --to axolotl --study-dir results/axolotl-gemma3-tiny "
    "--out results/axolotl-gemma3-tiny/fixed.yaml": ("elsewhere", RECIPES),
    "python scripts/tunegrid.py import examples/trl-gemma3-tiny.yaml --failure nan "
    "--out examples/trl-gemma3-tiny.study.yaml": ("elsewhere", RECIPES),
    "snakemake --cores 8 all --config study=examples/trl-gemma3-tiny.study.yaml": ("elsewhere", RECIPES),
    "python scripts/tunegrid.py export recommended --to trl --study-dir results/trl-gemma3-tiny "
    "--out results/trl-gemma3-tiny/fixed.yaml": ("elsewhere", RECIPES),
}


DOCTOR_TESTS = "tests/workflow/test_doctor_study.py and tests/run/test_doctor_command.py run the doctor"
GPU_CALL = "a device call on the lent GPU machine (docs/gpu.md)"
STACK_TESTS = "what the stacks rule runs and refuses; tests/prepare/test_stacks.py builds stacks through it"
HOW.update(
    {
        "tunegrid doctor <your axolotl / TRL recipe, or a study>": (
            "name",
            "README points at the doctor page, whose commands are its forms",
        ),  # noqa: E501
        "tunegrid doctor": ("name", "the command named in prose"),
        "tunegrid doctor examples/axolotl-gemma3-tiny.yaml": ("elsewhere", DOCTOR_TESTS),
        "tunegrid doctor configs/memory-fixes-oom-cpu.yaml": ("elsewhere", DOCTOR_TESTS),
        "tunegrid doctor configs/collective-timeout-cpu.yaml --cell qwen3moe-tiny_fp32_bs2_none_s0_ws2_ct5_fault-stall-rank": (  # noqa: E501
            "elsewhere",
            DOCTOR_TESTS,
        ),  # noqa: E501
        "tunegrid doctor my-recipe.yaml --first": ("elsewhere", DOCTOR_TESTS),
        "tunegrid doctor my-recipe.yaml --steps 200": ("elsewhere", DOCTOR_TESTS),
        "tunegrid doctor my-recipe.yaml --target t4": (
            "elsewhere",
            "tests/run/test_doctor_command.py: the recipe's study targets the card",
        ),
        "tunegrid import --target": ("name", "the option named in prose; tests/run/test_doctor_command.py runs it"),
        'tunegrid doctor my-study.yaml --snakemake "--profile slurm"': (
            "cannot",
            "needs a SLURM cluster (the profile runs in tests/workflow/test_slurm.py)",
        ),  # noqa: E501
        "python scripts/tunegrid.py doctor …": ("name", "the doctor through the repository script"),
        "tunegrid doctor: gemma3-tiny-fp16 / gemma3-tiny_fp16_bs2_none_s0": ("name", "the end screen quoted"),
        "tunegrid export recommended": ("name", "its full forms are the recipe commands"),
        "snakemake all": ("name", "the target named in prose"),
        "snakemake --cores 8 doctor --config study=<study>.yaml": ("elsewhere", DOCTOR_TESTS),
        "snakemake --cores 8 results/<study>/doctor/<cell_id>/first/doctor.json --config study=<study>.yaml": (
            "elsewhere",
            DOCTOR_TESTS,
        ),  # noqa: E501
        "bash scripts/gpu_acceptance.sh --cpu --out DIR": (
            "elsewhere",
            "tests/workflow/test_gpu_acceptance.py runs the CPU mode",
        ),  # noqa: E501
        "python3 scripts/gpu/kit.py build": (
            "elsewhere",
            "tests/workflow/test_gpu_kit.py builds a kit from local wheels",
        ),  # noqa: E501
        "bash scripts/gpu_acceptance.sh --receive .gpu-kit/load-1 --only tests --budget-s 240": ("cannot", GPU_CALL),
        "python3 scripts/gpu/kit.py receive .gpu-kit/load-2": ("cannot", GPU_CALL),
        "python3 scripts/gpu/kit.py receive .gpu-kit/load-3": ("cannot", GPU_CALL),
        "python3 scripts/gpu/kit.py receive .gpu-kit/load-4": ("cannot", GPU_CALL),
        "python3 scripts/gpu/kit.py receive .gpu-kit/load-5": ("cannot", GPU_CALL),
        "bash scripts/gpu_acceptance.sh --receive .gpu-kit/load-6 --only real,moe --budget-s 300": ("cannot", GPU_CALL),
        "bash scripts/gpu_acceptance.sh --only timing,paged --budget-s 240": ("cannot", GPU_CALL),
        "python -m venv --without-pip results/stacks/<key>/venv": ("name", STACK_TESTS),
        "pip --python <stack python> install <pins>": ("name", STACK_TESTS),
        "pip freeze": ("name", STACK_TESTS),
        "tunegrid stack: error: stack 'clash' cannot be built: pip cannot resolve tg-stack-a==1.0 tg-stack-b==2.0:": (
            "name",
            STACK_TESTS,
        ),  # noqa: E501
        "snakemake all --cores 2 --config study=configs/moe-stacks-cpu.yaml": ("elsewhere", STACK_TESTS),
        "pip install transformers==4.57.*": ("name", "the advice an export writes where a stack is the fix"),
    }
)


def readme_commands() -> list[str]:
    """The shell commands README.md and every docs page show, each once."""
    found: list[str] = []
    for page in PAGES:
        found += page_commands(page)
    return list(dict.fromkeys(found))


def page_commands(page: Path) -> list[str]:
    found: list[str] = []
    fence, language = False, ""
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence, language = not fence, line[3:].strip()
            continue
        if fence and language in OUTPUT:
            continue  # a program's output, a file's text or code: no shell command
        if fence:
            body = line.split("  #")[0].strip()
            if body.startswith(STARTS):
                found.append(body)
        else:
            found += [
                span.strip() for span in re.findall(r"`([^`]+)`", line) if span.startswith(STARTS) and " " in span
            ]
    return list(dict.fromkeys(found))


_env = shell_env


def test_every_readme_command_has_a_way_to_be_exercised():
    commands = readme_commands()
    unknown = [c for c in commands if c not in HOW]
    assert not unknown, f"commands README or docs/ show that no test exercises (add them to HOW): {unknown}"
    stale = [c for c in HOW if c not in commands]
    assert not stale, f"HOW lists commands no page shows any more: {stale}"
    kinds = {"run", "each", "dry", "server", "elsewhere", "cannot", "name"}
    assert all(how in kinds and reason for how, reason in HOW.values())


@pytest.fixture(scope="module")
def clone(default_study_clone) -> Path:
    """conftest's one run of README's main job in a fresh copy of this checkout (shared with the other tests
    that read the default study's results)."""
    assert HOW_MAIN == DEFAULT_STUDY_COMMAND
    return default_study_clone


@pytest.mark.slow
def test_the_default_study_reads_at_a_glance_in_the_terminal_and_in_mlflow(clone):
    """The main command's last lines name the outcome counts and the report; in the MLflow store a nan cell
    is FAILED and named by its outcome, an ok cell FINISHED, and every cell run has system metrics."""
    import pandas as pd

    from tunegrid.track.store import client
    from tunegrid.track.tags import distinct_part
    from tunegrid.track.tracking import CELL_TAG

    summary = pd.read_csv(clone / "results" / "default" / "summary.csv", keep_default_na=False)
    counts = summary["outcome"].value_counts()
    tail = (clone / "main-output.txt").read_text().strip().splitlines()[-8:]
    head = next(line for line in tail if line.startswith(f"tunegrid study 'default': {len(summary)} cells: "))
    assert all(f"{n} {outcome}" in head for outcome, n in counts.items()), (head, counts)
    assert "report: results/default/report/index.html" in tail, tail
    c = client(f"sqlite:///{clone / 'results' / 'mlflow.db'}")
    experiment = c.get_experiment_by_name("tunegrid/default")
    runs = [r for r in c.search_runs([experiment.experiment_id], max_results=200) if CELL_TAG in r.data.tags]
    assert len(runs) == len(summary) and counts.get("nan", 0) > 0
    for run in runs:
        outcome = run.data.tags["outcome"]
        assert run.info.run_name == f"{outcome} · {distinct_part(run.data.tags[CELL_TAG], summary['cell_id'])}"
        assert run.info.status == ("FINISHED" if outcome == "ok" else "FAILED"), run.info.run_name
        assert "system/cpu_utilization_percentage" in run.data.metrics, run.info.run_name


@pytest.mark.slow
@pytest.mark.parametrize("command", [c for c, (how, _) in HOW.items() if how == "run" and not c.startswith(INSTALL)])
def test_run_as_written(command, clone):
    if (
        "screenshots" in command
        and shutil.which("chromium") is None
        and not os.environ.get("TUNEGRID_REQUIRE_SYSTEM_TOOLS")
    ):
        pytest.skip("needs Debian's chromium (.ci/run installs it)")
    done = shell(command.replace("<study>", "default"), clone)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


@pytest.mark.parametrize("command", [c for c, (how, _) in HOW.items() if how == "each"])
def test_each_study_as_written(command, fresh_checkout):
    for study in STUDIES if "<study>" in command else [""]:
        line = command.replace("<study>", study)
        done = shell(line, fresh_checkout, timeout=300)
        assert done.returncode == 0, f"{line}: {(done.stdout + done.stderr)[-3000:]}"


# one test per command line (a command that names <study>, once per shipped study), each line once
DRY = [c for c, (how, _) in HOW.items() if how == "dry"]
DRY_LINES = list(dict.fromkeys(c.replace("<study>", s) for c in DRY for s in (STUDIES if "<study>" in c else [""])))


@pytest.mark.parametrize("line", DRY_LINES)
def test_dry_run_as_written(line, fresh_checkout):
    # from the root of a fresh copy, as README says: the checkout's own results (a newcomer who ran the main
    # command has the default study's) would leave nothing to be done
    done = shell(f"{line} -n", fresh_checkout, timeout=300)
    assert done.returncode == 0, f"{line}: {(done.stdout + done.stderr)[-3000:]}"
    if "study=configs/" in line:  # a shipped study (each has one such line): it plans its cells, no download
        assert "finetune" in done.stdout, f"{line}: {done.stdout[-2000:]}"


@pytest.mark.slow
def test_mlflow_ui_as_written_serves_and_stops_on_ctrl_c(clone):
    (command,) = [c for c, (how, _) in HOW.items() if how == "server"]
    import socket

    with socket.socket() as probe:  # README's command serves on 5000: another server there is not this one
        if probe.connect_ex(("127.0.0.1", 5000)) == 0:
            pytest.skip("something already listens on 127.0.0.1:5000 on this host")
    proc = subprocess.Popen(
        ["bash", "-c", f"exec {command}"],
        cwd=clone,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline, status = time.time() + 120, None
        while time.time() < deadline and status is None:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            try:
                with urllib.request.urlopen("http://127.0.0.1:5000/health", timeout=5) as response:
                    status = response.status
            except OSError:
                time.sleep(1)
        assert status == 200, "the UI never answered on 127.0.0.1:5000"
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    # Ctrl-C is how it is meant to end: the server stops cleanly (no traceback), and so does Snakemake, which gets
    # the Ctrl-C too (its hook ends an invocation whose UI stopped on request with 0, not a WorkflowError).
    assert "MLflow UI stopped" in out and "Traceback" not in out, out[-3000:]
    assert re.search(
        r"MLflow UI: http://127\.0\.0\.1:5000/#/experiments/\d+/runs\?workflowType=machine_learning\S* ", out
    ), "the study's runs page"
    assert proc.returncode == 0 and "WorkflowError" not in out, out[-3000:]
    assert subprocess.run(["pgrep", "-f", f"mlflow.*{clone}"], capture_output=True, check=False).stdout == b"", (
        "no server left behind"
    )


@pytest.mark.slow
def test_readme_commands_pass_in_a_checkout_where_the_main_job_has_run(clone):
    """README's two commands in order: the main job has run in `clone` (its results, Snakemake's records and
    the MLflow store are there), then this module's tests that run from the repository root run in it -- its
    own copy of the suite, in one process -- and pass, leaving that work as it was (the copy's session fails
    if they changed it)."""
    module = Path(__file__).relative_to(REPO)
    before = sorted((clone / "results").rglob("*"))
    done = shell(f"python -m pytest {module} -m 'not slow' -n 0 -q -p no:cacheprovider", clone, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert " passed" in done.stdout.splitlines()[-1] and "failed" not in done.stdout.splitlines()[-1]
    assert sorted((clone / "results").rglob("*")) == before
