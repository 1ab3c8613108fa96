"""What every benchmark shares: the device it runs on and the facts recorded beside its figures.

`--device cuda|cpu` (default: cuda when a GPU is visible). Asking for cpu on a GPU machine hides the
GPUs from this process *before torch is imported* (`CUDA_VISIBLE_DEVICES=""`), because tunegrid's
trainer trains on the GPU whenever one is visible. So `pick_device` must run before any import of
torch or of tunegrid's training code.

Absolute times mean something only on a GPU: on a shared CPU they move with whatever else runs, so
CPU results print ratios only (the JSON keeps the raw seconds for the record).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUT_DIR = REPO / "results" / "benchmarks"
LIBRARIES = ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "mlflow", "snakemake")


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=None,
        help="where to measure (default: cuda when a GPU is visible, else cpu)",
    )


def _gpu_visible() -> bool:
    """Whether a CUDA device is visible, asked in a way that does not initialise CUDA here."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    import torch

    return torch.cuda.is_available()


def pick_device(requested: str | None) -> str:
    """Resolve --device; hiding the GPUs for cpu must happen before torch is imported."""
    if requested == "cpu":
        if "torch" in sys.modules:
            raise RuntimeError("pick_device('cpu') must run before torch is imported")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        return "cpu"
    visible = _gpu_visible()
    if requested == "cuda" and not visible:
        sys.exit("--device cuda: no CUDA device is visible to this process")
    return "cuda" if visible else "cpu"


def device_from_argv(argv: list[str] | None = None) -> str:
    """pick_device for the --device of the command line, read before the script's own parser runs
    (the script imports torch and tunegrid afterwards)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_device_argument(parser)
    known, _ = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    return pick_device(known.device)


def machine_facts(device: str) -> dict[str, Any]:
    """GPU name, driver, CUDA and library versions (or the CPU model), recorded beside every figure."""
    import torch

    facts: dict[str, Any] = {
        "device": device,
        "python": platform.python_version(),
        "versions": {name: _version(name) for name in LIBRARIES},
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if device == "cuda":
        from tunegrid.prepare.probes import driver_version

        props = torch.cuda.get_device_properties(0)
        facts.update(
            gpu=props.name,
            gpu_memory_bytes=props.total_memory,
            compute_capability=f"{props.major}.{props.minor}",
            driver=driver_version(),
            cuda=torch.version.cuda,
        )
    return facts


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe(facts: dict[str, Any]) -> str:
    """One line naming the machine, printed above every table."""
    v = facts["versions"]
    stack = f"torch {v['torch']}, transformers {v['transformers']}, peft {v['peft']}, bitsandbytes {v['bitsandbytes']}"
    if facts["device"] == "cuda":
        return (
            f"{facts['gpu']} (cc {facts['compute_capability']}), driver {facts['driver']}, CUDA {facts['cuda']}, "
            f"{stack}"
        )
    return f"CPU: {facts['cpu']} ({facts['cpu_count']} cores, {facts['torch_threads']} torch threads), {stack}"


def absolute_times(facts: dict[str, Any]) -> bool:
    """Absolute times are reported from a GPU only; ratios always."""
    return facts["device"] == "cuda"


def write_results(name: str, facts: dict[str, Any], rows: Any, out_dir: str | Path = OUT_DIR) -> Path:
    """results/benchmarks/<name>.json: the machine facts and the rows, side by side."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps({"machine": facts, "rows": rows}, indent=2, default=str) + "\n")
    return path
