"""What a result was produced with: versions, torch build, CUDA/NCCL, bitsandbytes backend, git sha, host.

`light_env` imports nothing heavy (it runs in every cell's supervisor); `full_env` imports torch and
bitsandbytes once, in the environment rule.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
from typing import Any

from tunegrid.runtime.packages import package_version
from tunegrid.study.config import REPO_ROOT

CORE_PACKAGES = (
    "torch",
    "transformers",
    "peft",
    "bitsandbytes",
    "mlflow",
    "snakemake",
    "pandas",
    "tokenizers",
    "safetensors",
    "accelerate",
)


def git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=5,
    )
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def light_env() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "git_sha": git_sha(),
        "packages": {name: package_version(name) for name in CORE_PACKAGES},
        "scheduler": scheduler_env(),
    }


SCHEDULER_VARS = (
    "SLURM_JOB_ID",
    "SLURM_JOB_NAME",
    "SLURM_JOB_PARTITION",
    "SLURM_CPUS_PER_TASK",
    "SLURM_MEM_PER_NODE",
    "SLURM_GPUS",
    "SLURM_JOB_GPUS",
    "SLURM_GPUS_ON_NODE",
    "CUDA_VISIBLE_DEVICES",
)


def scheduler_env() -> dict[str, str]:
    """What the scheduler gave this job (empty outside SLURM): which job ran a cell, with which GPUs."""
    return {name: os.environ[name] for name in SCHEDULER_VARS if name in os.environ}


def full_env() -> dict[str, Any]:
    import torch

    env = light_env()
    env["executable"] = sys.executable
    env["torch"] = {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
        "cuda_available": torch.cuda.is_available(),
        "device_count": torch.cuda.device_count(),
        "gloo_available": torch.distributed.is_gloo_available(),
        "nccl_available": torch.distributed.is_nccl_available(),
        "num_threads": torch.get_num_threads(),
    }
    env["bitsandbytes"] = bitsandbytes_backend()
    env["all_packages"] = sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions())
    return env


def bitsandbytes_backend() -> dict[str, Any]:
    """Which bitsandbytes backend loaded, and whether a 4-bit round trip really runs here."""
    try:
        import bitsandbytes.functional as bnbf
        import torch
    except Exception as exc:  # a broken native library shows up here, not at training time
        return {"importable": False, "error": f"{type(exc).__name__}: {exc}"}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        weight = torch.randn(64, 64, device=device)
        packed, state = bnbf.quantize_4bit(weight, quant_type="nf4")
        restored = bnbf.dequantize_4bit(packed, state)
        error = float((restored - weight).abs().mean())
        return {"importable": True, "device": device, "nf4_roundtrip_mean_abs_error": error, "nf4_runs": True}
    except Exception as exc:
        return {"importable": True, "device": device, "nf4_runs": False, "error": f"{type(exc).__name__}: {exc}"}


def cpu_onednn_matmul() -> dict[str, bool]:
    """Whether torch hands this CPU's bf16 and fp16 matmuls to oneDNN: what torch itself checks (fp16 where the
    CPU has AVX512-FP16 or AMX-FP16; bf16 on AVX512, emulated where the CPU lacks AVX512-BF16). The probe records
    it, and the plan turns oneDNN off for the cells it would grow step by step (tunegrid.prepare.cpu_kernels)."""
    import torch

    checks = {"bf16": "_is_mkldnn_bf16_supported", "fp16": "_is_mkldnn_fp16_supported"}
    available = torch.backends.mkldnn.is_available()
    # a torch without a check: its oneDNN path is not known to take that dtype
    return {
        name: bool(available and hasattr(torch.ops.mkldnn, check) and getattr(torch.ops.mkldnn, check)())
        for name, check in checks.items()
    }
