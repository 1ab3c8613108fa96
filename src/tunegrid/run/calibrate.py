"""What a CPU worker holds at its peak beyond the tensors the memory estimate counts, measured on this host by
running a micro cell through the real worker on each path (spawned, and forked by a warm worker).

Why a micro cell rather than the process before a model: a worker's resident set grows while it works, not
only with its tensors. Loading touches the safetensors and tokenizer libraries, the step touches torch's
forward and backward kernels and oneDNN's JIT code, and a forked worker, which maps its parent's libraries
lazily, pulls in every page of code it runs (2-core AMD EPYC, torch 2.13: a forked worker starts ~90 MiB below
a spawned one and grows ~25 MiB more while it works). Those pages are the same whatever the model's size, so a
model too small for its tensors to matter (a few hundred kB) measures them: its peak less the estimate of its
own tensors is the constant, per worker path and arithmetic. Nothing here is fitted: the probe measures it on
the machine that trains.

A spawned worker per arithmetic would cost a fresh import each (seconds); the arithmetic's own share (oneDNN's
kernels for bf16, the emulation for fp16) is anonymous memory and code neither path holds before its first
step, so a spawned worker's figure for bf16/fp16 is its fp32 figure plus what that arithmetic adds in a fork.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tunegrid.runtime.workers import FORKED, SPAWNED, WARM_SOCKET_ENV
from tunegrid.vocabulary import Precision, Quant

ARITHMETICS = (Precision.FP32, Precision.BF16, Precision.FP16)
# A Llama decoder small enough that its tensors are noise beside the runtime (~0.2 MB of weights), trained the
# way every cell trains (the schema's defaults: instruments, clipping, schedule, adapter save, reference loss).
MICRO_STUDY: dict[str, Any] = {
    "study": "calibration",
    "models": {
        "micro": {
            "source": "synthetic",
            "architecture": "llama",
            "seed": 0,
            "config": {
                "vocab_size": 512,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 16,
            },
        }
    },
    "grid": {"model": ["micro"], "precision": list(ARITHMETICS)},  # plain LoRA (below); the other axes: defaults
    "train": {"steps": 4, "seq_len": 64, "warmup_steps": 0, "headroom_every": 2},
    "data": {"examples": 32},
    "tracking": {"enabled": False},
}


def worker_runtime_bytes(work_dir: Path | None = None) -> dict[str, Any]:
    """{spawned: {arithmetic: bytes}, forked: {...}, seconds}: each worker path's peak beyond its tensors.
    An arithmetic whose micro cell did not end ok is left out (the estimate then falls back to the probe's
    older constants for it)."""
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if work_dir is None:
            work_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tunegrid-calibrate-")))
        study, model_dir, data = _micro_study(work_dir)
        forked: dict[str, int] = {}
        # the warm worker imports while the spawned micro cell runs: the two overlap, neither's memory changes
        with serving_warm_worker(work_dir) as warm_socket:
            spawned_fp32 = _beyond_tensors(study, Precision.FP32, model_dir, data, work_dir / SPAWNED, None)
            if warm_socket() is not None:
                for arithmetic in ARITHMETICS:
                    measured = _beyond_tensors(study, arithmetic, model_dir, data, work_dir / FORKED, warm_socket())
                    if measured is not None:
                        forked[arithmetic] = measured
    spawned: dict[str, int] = {}
    if spawned_fp32 is not None:
        spawned[Precision.FP32] = spawned_fp32
        for arithmetic in ARITHMETICS[1:]:
            if arithmetic in forked and Precision.FP32 in forked:
                spawned[arithmetic] = spawned_fp32 + forked[arithmetic] - forked[Precision.FP32]
    return {SPAWNED: spawned, FORKED: forked, "seconds": round(time.perf_counter() - started, 1)}


def _micro_study(work_dir: Path) -> tuple[dict[str, Any], Path, Path]:
    from tunegrid.dataset import read_dataset
    from tunegrid.prepare.checkpoints import produce_checkpoint
    from tunegrid.prepare.data import corpus_texts, write_dataset
    from tunegrid.study.config import resolve_study

    study = resolve_study({**MICRO_STUDY, "grid": {**MICRO_STUDY["grid"], "quant": [Quant.NONE]}})
    data = work_dir / "train.jsonl"
    write_dataset(data, study["data"]["examples"], 0)
    model_dir = work_dir / "micro"
    produce_checkpoint(study["models"]["micro"], list(corpus_texts(read_dataset(data))), model_dir)
    return study, model_dir, data


@contextlib.contextmanager
def serving_warm_worker(work_dir: Path) -> Iterator[Callable[[], str | None]]:
    """The warm worker forked cells come from: the invocation's, where this process runs in one that has
    one (the very process its cells will be forked from, before any cell is), else one of this process's own,
    started at once (a second import of the training stack would cost seconds of CPU). The callable waits until
    it serves and returns its socket, or None where it does not serve."""
    from tunegrid.run import warm
    from tunegrid.run.warm_client import ready_info

    invocation = os.environ.get(WARM_SOCKET_ENV)
    if invocation:  # waited for only once the spawned micro cell has run: it may still be importing
        yield lambda: invocation if ready_info(Path(invocation), wait_s=900.0) is not None else None
        return
    path = warm.socket_path(f"calibrate-{os.getpid()}-{time.monotonic_ns()}")
    proc = warm.start(path, work_dir / "warm.log")
    try:
        # a hang guard, not a speed limit: ready_info returns at once if the worker dies, and a loaded host may
        # take minutes to import torch; giving up early would drop the forked constants for a slow host only
        yield lambda: str(path) if ready_info(path, wait_s=900.0) is not None else None
    finally:
        warm.stop(proc, path)


def _beyond_tensors(
    study: dict[str, Any], arithmetic: str, model_dir: Path, data: Path, runs: Path, warm_socket: str | None
) -> int | None:
    """The micro cell's measured peak less the estimate's tensors for it (no runtime constant)."""
    from tunegrid.contract import CellJob
    from tunegrid.prepare.cell_plan import write_contract
    from tunegrid.run.supervisor import run_cell
    from tunegrid.study.config import cell_spec, expand_cells

    cell = next(c for c in expand_cells(study) if c.precision == arithmetic)
    spec = cell_spec(study, cell)
    run_dir = runs / cell.cell_id
    job = CellJob(
        model_dir=str(model_dir), data_path=str(data), run_dir=str(run_dir), result_path=str(run_dir / "result.json")
    )
    # no probe record: no target, and the estimate's tensors alone (no runtime constant), on the CPU
    contract_path = runs / f"{cell.cell_id}.contract.json"
    contract = write_contract(spec, job, contract_path, warm_worker=bool(warm_socket), capabilities={})
    previous = os.environ.pop(WARM_SOCKET_ENV, None)  # the spawned path runs without one
    if warm_socket:
        os.environ[WARM_SOCKET_ENV] = warm_socket
    try:
        result = run_cell(contract_path, command=["tunegrid", "calibrate"])
    finally:
        os.environ.pop(WARM_SOCKET_ENV, None)
        if previous is not None:
            os.environ[WARM_SOCKET_ENV] = previous
    peak = result["memory"].get("peak_bytes")
    if result["outcome"] != "ok" or not peak:
        return None
    tensors = contract.plan.estimate().step_bytes
    return int(peak - tensors)
