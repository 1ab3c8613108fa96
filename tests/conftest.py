"""Shared fixtures: tiny studies and synthetic checkpoints built once per test session."""

from __future__ import annotations

import copy
import fcntl
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cpu_times
import pytest
from cpu_times import (  # noqa: F401 — CPU seconds per test (--cpu-durations)
    pytest_addoption,
    pytest_runtest_logreport,
    pytest_runtest_makereport,
    pytest_runtest_setup,
    pytest_terminal_summary,
)
from xdist_groups import pytest_collection_modifyitems  # noqa: F401 — which tests share a pytest-xdist worker

if TYPE_CHECKING:  # for the annotations only: src goes on the path below, and tunegrid is imported where needed
    from tunegrid.cell_spec import CellSpec

if importlib.util.find_spec("xdist") is not None:
    from xdist_groups import pytest_xdist_make_scheduler  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The suite's pytest-xdist workers run side by side, each training cells with their own torch threads, so the
# threads of all of them often outnumber the cores. OpenMP's default wait spins: a thread waiting at the end of an
# operator holds a core that the thread it waits for needs, and the other worker's cells crawl. Passive waits
# (every process the session starts inherits them): two memory_estimate.py runs side by side took 69 s each,
# 28 s with them; the whole suite on 2 cores took 18 min 23 s without them and 14–16 min with them over four runs
# (docs/measurements.md). A caller's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Every process this test session starts inherits this marker (snakemake, supervisors, warm workers and the
# workers they fork, even once reparented), so processes_mentioning sees this session's processes only and
# not those of another checkout's suite or pipeline running on the same host (each pytest-xdist worker has its own).
# The suite's studies read data files from its temporary folders, outside the folder they run in.
os.environ.setdefault("TUNEGRID_DATA_ROOTS", tempfile.gettempdir())

SESSION_ENV = "TUNEGRID_TEST_SESSION"
os.environ[SESSION_ENV] = uuid.uuid4().hex

# The session's one cache of dequantized GGUF checkpoints (prepare/gguf_cache.py), shared by its tests, the
# Snakemake runs and the acceptance script they start (all inherit the environment): each GGUF is dequantized once
# a session, not once a study. pytest_configure makes it in the controller, before pytest-xdist starts the workers
# that inherit it; a TUNEGRID_CACHE the caller set wins. A test about the cache itself sets its own.
CACHE_ENV = "TUNEGRID_CACHE"
_SESSION_CACHE = pytest.StashKey[Path]()


@pytest.hookimpl(trylast=True)  # after the tmp_path plugin's, which makes the base temporary folder
def pytest_configure(config: pytest.Config) -> None:
    """The session's cache, made by the controller (or the one process of `-n 0`)."""
    if hasattr(config, "workerinput") or os.environ.get(CACHE_ENV):  # a worker: the controller's is inherited
        return
    folder = config._tmp_path_factory.getbasetemp() / "tunegrid-cache"  # the run's, above each worker's own
    folder.mkdir(exist_ok=True)
    os.environ[CACHE_ENV] = str(folder)
    config.stash[_SESSION_CACHE] = folder


def pytest_unconfigure(config: pytest.Config) -> None:
    """The session's cache removed with it (a gigabyte and more once the real models have been dequantized)."""
    folder = config.stash.get(_SESSION_CACHE, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(CACHE_ENV, None)


# The user's own work in this checkout: a newcomer who ran README's main command first has the default study's
# results, Snakemake's records and the MLflow store here. No test reads or writes them: each runs in a copy of the
# checkout or a temporary folder. The controller fingerprints them when the session starts and fails the session
# if any changed by its end.
USERS_WORK = ("results", ".snakemake", "mlruns", "mlartifacts", "mlflow.db")
_USERS_WORK = pytest.StashKey[dict[str, tuple[int, int]]]()


def users_work_fingerprint(root: Path) -> dict[str, tuple[int, int]]:
    """Every file of the user's work under `root`: its size and modification time, by path."""
    found = {}
    for name in USERS_WORK:
        top = root / name
        for path in [top] if top.is_file() else (top.rglob("*") if top.is_dir() else []):
            if path.is_file() and not path.is_symlink():
                stat = path.stat()
                found[str(path.relative_to(root))] = (stat.st_size, stat.st_mtime_ns)
    return found


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):
        session.config.stash[_USERS_WORK] = users_work_fingerprint(REPO)


def fail_if_users_work_changed(session: pytest.Session) -> None:
    """Called when the session ends (pytest_sessionfinish, below)."""
    before = session.config.stash.get(_USERS_WORK, None)
    if before is None:
        return
    after = users_work_fingerprint(REPO)
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    if changed:
        shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        sys.stderr.write(f"\nthe test session changed the checkout's own results or records: {shown}\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


COPY_IGNORES = (".git", ".venv", *USERS_WORK, "__pycache__", ".gpu-kit", "site")


def checkout_copy(destination: Path) -> Path:
    """A copy of this checkout's files without the user's work, the venv or git's records: what a fresh clone
    holds, for a test that runs commands as written from the repository root."""
    shutil.copytree(REPO, destination, ignore=shutil.ignore_patterns(*COPY_IGNORES))
    return destination


@pytest.fixture(scope="session")
def fresh_checkout(tmp_path_factory) -> Path:
    """One copy of the checkout per session (per pytest-xdist worker) for commands that write nothing a test
    reads: validation and dry runs."""
    return checkout_copy(tmp_path_factory.mktemp("fresh") / "tunegrid")


def snakemake_command(workdir: Path, *args: str) -> list[str]:
    """This workflow's snakemake command line, run in `workdir` as in a user's own project folder."""
    return [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir), *args]


# Snakemake options that run no job: a test that uses only these is not an end-to-end run
NO_JOBS = frozenset(
    {"-n", "--dry-run", "--dryrun", "--lint", "--unlock", "--list-rules", "--summary", "-S", "--detailed-summary", "-D"}
)


def runs_snakemake_jobs(args: Any) -> bool:
    """Whether a subprocess command line runs Snakemake jobs (an end-to-end run): `snakemake` or
    `python -m snakemake`, directly or inside `bash -c`, without an option that runs no job."""
    words = (args if isinstance(args, str | bytes) else " ".join(str(a) for a in args)).split()
    words = [w.decode() if isinstance(w, bytes) else w for w in words]
    snakemake = any(w.strip("'\"") == "snakemake" or w.endswith("/snakemake") for w in words)
    return snakemake and not any(w.strip("'\"") in NO_JOBS for w in words)


@pytest.fixture(autouse=True)
def _end_to_end_runs_are_marked_slow(request, monkeypatch):
    """A test that runs Snakemake jobs must be marked `slow`, so `-m 'not slow'` stays the fast tier: outside
    a slow test, starting such a process fails the test naming the command."""
    if any(request.node.get_closest_marker(mark) is not None for mark in ("slow", "gpu")):
        return  # GPU tests are opt-in (`-m gpu`) and never in the fast tier
    start = subprocess.Popen.__init__

    def guarded(self, args, *rest, **kwargs):
        if runs_snakemake_jobs(args):
            pytest.fail(f"{request.node.nodeid} runs Snakemake jobs ({args!r}): mark it @pytest.mark.slow")
        start(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)


def workflow_env(*also_drop: str) -> dict[str, str]:
    """The environment without the caller's MLflow store, so each run writes its own under its folder."""
    dropped = {"MLFLOW_TRACKING_URI", *also_drop}
    return {k: v for k, v in os.environ.items() if k not in dropped}


def shell_env() -> dict[str, str]:
    """workflow_env() for a command typed in a shell: `python`, `snakemake` and `tunegrid` are this venv's."""
    env = workflow_env("TUNEGRID_EXECUTION_ID")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def shell(command: str, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    """A command line run by bash, as a user types it."""
    return subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=shell_env(), capture_output=True, text=True, timeout=timeout, check=False
    )


DEFAULT_STUDY_COMMAND = "snakemake --cores 8 all"  # README's main job, after its install steps


@pytest.fixture(scope="session")
def default_study_clone(tmp_path_factory) -> Path:
    """A copy of this checkout (no results, no venv) with README's main job run in it, as a newcomer's checkout
    is after the first command: the default study, end to end. One run for the session, shared by every test
    that reads its results (README's commands, the MLflow UI, the adapter snippet); only `slow` tests use it."""
    root = checkout_copy(tmp_path_factory.mktemp("newcomer") / "tunegrid")
    done = shell(DEFAULT_STUDY_COMMAND, root, timeout=1500)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    (root / "main-output.txt").write_text(done.stdout + done.stderr)
    return root


# the grid of one fp32 cell of the tiny MoE, the cell most tests of the run and the workflow train
MOE_TINY_CELL = {"model": ["qwen3moe-tiny"], "precision": ["fp32"], "batch_size": [2], "quant": ["none"], "seed": [0]}

GEMMA_HOT = {
    "source": "synthetic",
    "architecture": "gemma3_text",
    "seed": 0,
    "config": {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "initializer_range": 3.0,
    },
}
QWEN_MOE = {
    "source": "synthetic",
    "architecture": "qwen3_moe",
    "seed": 0,
    "config": {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "initializer_range": 0.2,
    },
}

OLMOE = {
    "source": "synthetic",
    "architecture": "olmoe",
    "seed": 0,
    "config": {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "initializer_range": 0.2,
    },
}


def make_study(**overrides: Any) -> dict[str, Any]:
    """A small valid raw study config; keyword arguments replace top-level sections."""
    study: dict[str, Any] = {
        "study": "t",
        "models": {
            "gemma3-hot": copy.deepcopy(GEMMA_HOT),
            "qwen3moe-tiny": copy.deepcopy(QWEN_MOE),
            "olmoe-tiny": copy.deepcopy(OLMOE),
        },
        "grid": {"model": ["gemma3-hot"], "precision": ["fp32"], "batch_size": [2], "quant": ["none"], "seed": [0]},
        "train": {"steps": 3, "seq_len": 32, "lr": 0.01},
        "data": {"examples": 64},
    }
    study.update(overrides)
    return study


def slurm_dry_run_finetune_jobs(workdir: Path, config: Path) -> dict[str, dict[str, int]]:
    """cell id -> the resources (`nodes`, `tasks`, `cpus_per_task`, `mem_mb`, ...) `snakemake --profile slurm -n`
    shows for its finetune job, the study `config` run in `workdir`."""
    proc = subprocess.run(
        snakemake_command(workdir, "--profile", "slurm", "-n", "--configfile", str(config)),
        cwd=REPO,  # Snakemake finds the `slurm` profile in the folder it is started from
        env=workflow_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = {}
    for job in re.findall(r"rule finetune:\n(.*?)\n\n", proc.stdout + proc.stderr, flags=re.S):
        cell = re.search(r"runs/([^/]+)/result\.json", job).group(1)
        jobs[cell] = {key: int(value) for key, value in re.findall(r"\b(\w+)=(\d+)\b", job)}
    return jobs


def recorded_run(run: dict[str, Any]) -> dict[str, Any]:
    """A recorded run of tests/data, each cell's spec read with today's keys (its model the run's `models` entry):
    the keys it predates at the values the cells ran at."""
    from tunegrid.study.recorded import recorded_spec

    for cell in run["cells"]:
        model = run["models"][cell["spec"]["axes"]["model"]]
        cell["spec"] = recorded_spec({**cell["spec"], "model": model}).to_json()
    return run


def one_cell(**axes_and_sections: Any) -> dict[str, Any]:
    """The resolved spec of a one-cell study as its JSON (specs/<cell>.json's dict): one_cell_spec's, with its
    arguments."""
    return one_cell_spec(**axes_and_sections).to_json()


def one_cell_spec(
    *,
    model: str = "gemma3-hot",
    precision: str = "fp32",
    batch: int = 2,
    quant: str = "none",
    seed: int = 0,
    world: int = 1,
    accum: int = 1,
    train: dict[str, Any] | None = None,
    axes: dict[str, Any] | None = None,
    **sections: Any,
) -> CellSpec:
    """The resolved spec (a CellSpec) of a one-cell study: these axes (and any other axis's one value in `axes`),
    `train` merged over the small default, and any other section (debug, lora, hardware, distributed, data)
    replacing make_study's."""
    from tunegrid.study.config import cell_spec, expand_cells, resolve_study

    grid = {
        "model": [model],
        "precision": [precision],
        "batch_size": [batch],
        "quant": [quant],
        "seed": [seed],
        "world_size": [world],
        "grad_accum": [accum],
        **{axis: [value] for axis, value in (axes or {}).items()},
    }
    study = resolve_study(
        make_study(grid=grid, train={"steps": 3, "seq_len": 32, "lr": 0.01, **(train or {})}, **sections)
    )
    return cell_spec(study, expand_cells(study)[0])


def cell_contract(
    spec: dict[str, Any],
    checkpoints: dict[str, Path],
    dataset_path: Path,
    run_dir: Path,
    *,
    tracking: Path | None = None,
    capabilities: Path | None = None,
    warm_worker: bool | None = None,
) -> Path:
    """The cell's contract as the cell_plan rule makes it, written in its run folder; returns its path.
    `warm_worker`: the run forks its cells from a warm worker (None: where this process's jobs would find one)."""
    from tunegrid.cell_spec import CellSpec
    from tunegrid.contract import CellJob
    from tunegrid.prepare.cell_plan import write_contract
    from tunegrid.runtime.workers import WARM_SOCKET_ENV

    job = CellJob(
        model_dir=str(checkpoints[spec["model"]["name"]]),
        data_path=str(dataset_path),
        run_dir=str(run_dir),
        result_path=str(run_dir / "result.json"),
        capabilities_path=str(capabilities) if capabilities else None,
        tracking_path=str(tracking) if tracking else None,
    )
    path = run_dir / "contract.json"
    if warm_worker is None:
        warm_worker = bool(os.environ.get(WARM_SOCKET_ENV))
    write_contract(CellSpec.from_json(spec), job, path, warm_worker=warm_worker)
    return path


def stub_contract(cell_id: str, world_size: int, estimate_bytes: int, device: str = "cuda") -> Any:
    """A cell contract as the cell_plan rule writes one, with an estimate of the given size (for checkpoints that
    are not on disk): what the workflow's memory requests and the doctor read from it."""
    from tunegrid.cell_spec import CellSpec
    from tunegrid.contract import (
        CellContract,
        CellJob,
        CellKernels,
        CellPlan,
        LivenessLimits,
        MemoryComponents,
        MemoryEstimate,
    )
    from tunegrid.prepare.cell_plan import job_mem_mb

    estimate = MemoryEstimate(
        worker="spawned",
        estimate_bytes=estimate_bytes,
        stage="load",
        load_bytes=estimate_bytes,
        step_bytes=0,
        components=MemoryComponents(),
    )
    limits = LivenessLimits(
        heartbeat_timeout_s=300,
        time_limit_s=3600,
        predicted_step_s=None,
        step_flops=0,
        rate_tflops=None,
        margin=4.0,
        extra_steps=3,
    )
    plan = CellPlan(
        cell_id=cell_id,
        world_size=world_size,
        target="native",
        budget_bytes=None,
        device=device,
        worker="spawned",
        estimates={"spawned": estimate},
        kernels=CellKernels(),
        liveness=limits,
        mem_mb=job_mem_mb(estimate_bytes, world_size),
    )
    job = CellJob(model_dir="m", data_path="d", run_dir=f"runs/{cell_id}", result_path=f"runs/{cell_id}/result.json")
    spec = CellSpec.from_json({**one_cell(world=world_size), "cell_id": cell_id})
    return CellContract(spec=spec, plan=plan, job=job)


# This process's warm worker (tunegrid.run.warm), started at the first cell that forks and kept for the session:
# the cells the tests supervise are forked from it, as a local study's are from its invocation's, instead of each
# worker importing the training stack again (~7 CPU-s a process on a 2-core host). Its warm supervisor likewise,
# for the Snakemake runs that take both (with_session_warm_processes).
_SESSION_WARM: dict[str, dict[str, Any]] = {}  # role -> {"proc", "path"}


def session_warm_socket(role: str = "worker") -> str:
    """The socket of this test process's warm worker (or warm supervisor), started (again, if it has ended) on first
    use."""
    from tunegrid.run import warm

    proc = _SESSION_WARM.get(role, {}).get("proc")
    if proc is None or proc.poll() is not None:  # poll() reaps an ended one: its CPU is now this process's children's
        cpu_times.TRACKED.discard(getattr(proc, "pid", None))
        path = warm.socket_path(f"tests-{os.getpid()}-{uuid.uuid4().hex[:8]}", role)
        log = Path(os.environ.get(CACHE_ENV) or tempfile.gettempdir()) / f"warm-{path.stem}.log"
        _SESSION_WARM[role] = {"proc": warm.start(path, log, role), "path": path}
        cpu_times.TRACKED.add(_SESSION_WARM[role]["proc"].pid)  # the cells it forks count for the tests that ran them
    return str(_SESSION_WARM[role]["path"])


def with_session_warm_processes(env: dict[str, str]) -> dict[str, str]:
    """`env` naming this process's warm worker and warm supervisor, so a local Snakemake run started with it forks
    its jobs and cells from them, as an invocation inside another does (tunegrid.run.hooks), instead of starting and
    importing its own two (~8 CPU-s, and its first jobs wait for them). Only for a run in this checkout whose
    environment is this process's but for MLflow's store (workflow_env): the warm processes imported the stack with
    this process's environment. The tests of the warm processes' own start and lifetime do not take them."""
    from tunegrid.run import warm

    return {
        **env,
        warm.SOCKET_ENV: session_warm_socket(warm.WORKER),
        warm.SUPERVISOR_SOCKET_ENV: session_warm_socket(warm.SUPERVISOR),
    }


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The session's warm processes stopped with it (they also leave by themselves once this process is gone)."""
    if _SESSION_WARM:
        from tunegrid.run import warm

        for held in _SESSION_WARM.values():
            cpu_times.TRACKED.discard(held["proc"].pid)
            warm.stop(held["proc"], held["path"])
        _SESSION_WARM.clear()
    fail_if_users_work_changed(session)


def run_supervised(
    spec: dict[str, Any],
    checkpoints: dict[str, Path],
    dataset_path: Path,
    run_dir: Path,
    *,
    tracking: Path | None = None,
    capabilities: Path | None = None,
    worker: str = "forked",
) -> dict[str, Any]:
    """The cell as a finetune job runs it: its contract, the supervisor, worker process(es), result.json.
    `worker`: "forked" (where the cell's plan forks it: one CPU rank) from the session's warm worker, as a local
    study's cells are; "spawned": fresh processes, as on a GPU, a cluster or without a warm worker."""
    from tunegrid.run.supervisor import run_cell
    from tunegrid.runtime.workers import FORKED, WARM_SOCKET_ENV

    forked = worker == FORKED
    path = cell_contract(
        spec, checkpoints, dataset_path, run_dir, tracking=tracking, capabilities=capabilities, warm_worker=forked
    )
    previous = os.environ.pop(WARM_SOCKET_ENV, None)  # a test's own warm worker, where it started one, is the one
    if forked:
        os.environ[WARM_SOCKET_ENV] = previous or session_warm_socket()
    try:
        return run_cell(path, command=["tunegrid", "finetune"])
    finally:
        os.environ.pop(WARM_SOCKET_ENV, None)
        if previous is not None:
            os.environ[WARM_SOCKET_ENV] = previous


def run_in_process(
    spec: dict[str, Any], checkpoints: dict[str, Path], dataset_path: Path, run_dir: Path
) -> dict[str, Any]:
    """The training worker alone, in this process; returns its facts (worker.json)."""
    return work_cell(spec, checkpoints[spec["model"]["name"]], dataset_path, run_dir)


def work_cell(spec: dict[str, Any], model_dir: Path, dataset_path: Path, run_dir: Path) -> dict[str, Any]:
    """The worker of the cell's contract (made for `model_dir`) in this process; returns its facts (worker.json)."""
    from tunegrid.cell.train import run_worker
    from tunegrid.contract import CellContract
    from tunegrid.runtime.files import read_json

    path = cell_contract(spec, {spec["model"]["name"]: Path(model_dir)}, dataset_path, Path(run_dir))
    run_worker(CellContract.read(path))
    return read_json(Path(run_dir) / "worker.json")


def ready_trainer(spec: dict[str, Any], checkpoints: dict[str, Path], dataset_path: Path, tmp_path: Path) -> Any:
    """The cell's own set-up path (load, audit and adapt, data), stopped before the first step."""
    from tunegrid.cell.train import CellTrainer
    from tunegrid.contract import CellContract

    run_dir = tmp_path / spec["cell_id"]
    run_dir.mkdir(parents=True)
    trainer = CellTrainer(CellContract.read(cell_contract(spec, checkpoints, dataset_path, run_dir)), run_dir)
    trainer.setup()
    trainer.build_model()
    trainer.build_data()
    return trainer


_META_SHAPES: dict[str, tuple[dict, dict]] = {}


def meta_model_shapes(model: dict[str, Any]) -> tuple[dict, dict]:
    """config.json and parameter shapes of a synthetic checkpoint (a study's `models` entry), built on the meta
    device: what the memory estimate reads from a checkpoint's headers, for replaying recorded evidence."""
    key = json.dumps(model, sort_keys=True)
    if key not in _META_SHAPES:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.for_model(model["architecture"], **model["config"])
        with torch.device("meta"):
            built = AutoModelForCausalLM.from_config(config)
        # named_parameters counts a tied LM head once, as the checkpoint stores it
        _META_SHAPES[key] = (config.to_dict(), {name: list(p.shape) for name, p in built.named_parameters()})
    return _META_SHAPES[key]


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """A new folder `name` filled by make(folder) once for the whole run: under pytest-xdist the first worker to
    take the lock makes it in the run's base temporary folder and the others wait for it and read it (what a
    session fixture read by tests is; none writes into it)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        folder = tmp_path_factory.mktemp(name)
        make(folder)
        return folder
    root = tmp_path_factory.getbasetemp().parent  # the run's, above each worker's own
    folder = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (root / f"{name}.made").exists():
            shutil.rmtree(folder, ignore_errors=True)  # a worker that died while making it
            folder.mkdir()
            make(folder)
            (root / f"{name}.made").touch()
    return folder


@pytest.fixture(scope="session")
def dataset_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tunegrid.prepare.data import write_dataset

    folder = made_once(tmp_path_factory, "data", lambda made: write_dataset(made / "train.jsonl", 64, 0))
    return folder / "train.jsonl"


SESSION_MODELS = {"gemma3-hot": GEMMA_HOT, "qwen3moe-tiny": QWEN_MOE, "olmoe-tiny": OLMOE}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, dataset_path: Path) -> dict[str, Path]:
    from tunegrid.dataset import read_dataset
    from tunegrid.prepare.checkpoints import produce_checkpoint
    from tunegrid.prepare.data import corpus_texts

    def make(root: Path) -> None:
        texts = list(corpus_texts(read_dataset(dataset_path)))
        for name, spec in SESSION_MODELS.items():
            produce_checkpoint(copy.deepcopy(spec), texts, root / name)

    root = made_once(tmp_path_factory, "models", make)
    return {name: root / name for name in SESSION_MODELS}


@pytest.fixture(scope="session")
def _empty_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An MLflow sqlite store with MLflow's tables made and nothing else in it (its one Default experiment)."""
    from tunegrid.track.store import client

    path = tmp_path_factory.mktemp("mlflow-store") / "mlflow.db"
    client(f"sqlite:///{path}").search_experiments()  # MLflow creates the tables on first use
    return path


@pytest.fixture
def sqlite_store(_empty_store: Path):
    """new_store(path) -> the URI of a new, empty sqlite store at `path`. MLflow's migrations take seconds of CPU
    for each new store, so a test whose claim is not about making a store gets a copy of one made once per
    session: the same schema MLflow writes, and the same code from there on."""

    def new_store(path: Path) -> str:
        shutil.copyfile(_empty_store, path)
        return f"sqlite:///{path}"

    return new_store


def processes_mentioning(path: Path) -> list[str]:
    """PIDs of this test session's processes whose command line names `path`: what a cell left behind (must
    be none). Only processes carrying this session's marker in their environment count; the session's own warm
    processes (session_warm_socket), which live as long as the session, and what they fork do not."""
    found = []
    marker = f"{SESSION_ENV}={os.environ[SESSION_ENV]}".encode()
    session_warm = [str(held["path"]) for held in _SESSION_WARM.values()]  # their forks keep their command line
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                if str(path) not in cmdline or any(socket in cmdline for socket in session_warm):
                    continue
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:  # gone meanwhile, or another user's
                continue
            if marker in environ:
                found.append(pid)
    return found


# A QLoRA recipe as axolotl and TRL write one, for the importer's key tests (a hub model and dataset, unpinned)
AXOLOTL_QLORA_RECIPE = {
    "base_model": "org/some-model", "adapter": "qlora", "load_in_4bit": True, "lora_r": 16, "lora_alpha": 32,
    "lora_target_linear": True, "sequence_len": 2048, "micro_batch_size": 1, "gradient_accumulation_steps": 8,
    "num_epochs": 1, "learning_rate": 2e-4, "bf16": True, "gradient_checkpointing": True,
    "datasets": [{"path": "org/some-chats", "type": "chat_template"}],
}  # fmt: skip
TRL_PEFT_RECIPE = {
    "model_name_or_path": "org/some-model", "dataset_name": "org/some-chats", "use_peft": True,
    "learning_rate": 2e-4, "max_length": 1024, "per_device_train_batch_size": 2,
}  # fmt: skip
