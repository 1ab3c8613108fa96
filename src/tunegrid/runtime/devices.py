"""Which GPUs a cell's job asks the scheduler for and which ones its ranks train on, decided without torch
(by the Snakemake process that plans the jobs and by the supervisor that launches them).

`hardware.gpus_per_rank: auto` means one GPU per rank where a CUDA GPU is there, none elsewhere; 0 trains on
the CPU even where a GPU is visible (the ranks are started with no CUDA device), so what a job asks for is
always what it uses. A local job claims its own devices (one lock file per device, node-local), so jobs that
run side by side never share one; a job the cluster placed (SLURM) trains on what it was granted.
"""

from __future__ import annotations

import fcntl
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # one folder per GPU the driver sees (no CUDA context needed)
CLAIM_POLL_S = 1.0


def visible_gpu_count(env: dict[str, str] | None = None, driver_dir: Path = NVIDIA_GPUS) -> int:
    """The GPUs a process started now could use: the driver's devices, narrowed by CUDA_VISIBLE_DEVICES."""
    env = os.environ if env is None else env
    present = len(list(driver_dir.iterdir())) if driver_dir.is_dir() else 0
    listed = env.get(VISIBLE_ENV)
    if listed is None:
        return present
    return min(present, len(device_list(listed)))


def device_list(listed: str) -> list[str]:
    """CUDA_VISIBLE_DEVICES as a list; CUDA stops at the first invalid entry (-1 hides every device)."""
    devices = []
    for entry in (part.strip() for part in listed.split(",")):
        if not entry or entry.startswith("-"):
            break
        devices.append(entry)
    return devices


def gpus_per_rank(setting: str | int, capabilities: dict[str, Any] | None = None) -> int:
    """hardware.gpus_per_rank (`setting`: auto, 0 or 1) resolved: `auto` is 1 where the probe recorded CUDA (or,
    before the probe, where this machine shows a GPU), else 0."""
    if setting != "auto":
        return int(setting)
    if capabilities:
        return 1 if capabilities.get("device") == "cuda" else 0
    return 1 if visible_gpu_count() > 0 else 0


def training_device(setting: str | int, capabilities: dict[str, Any]) -> str:
    """The device a cell's ranks train on, "cuda" or "cpu": CUDA where each rank gets a GPU (gpus_per_rank) and
    there is CUDA to give (the probe recorded it; without a probe record, this machine shows a GPU), else the CPU
    (`gpus_per_rank: 0` trains on the CPU beside a GPU). The plan records it (tunegrid.contract.CellPlan.device);
    its estimate, kernels and verdicts are of that device, and the worker trains on it. `setting`:
    hardware.gpus_per_rank."""
    if gpus_per_rank(setting, capabilities) == 0:
        return "cpu"
    cuda = capabilities.get("device") == "cuda" if capabilities else visible_gpu_count() > 0
    return "cuda" if cuda else "cpu"


def cell_gpus(setting: str | int, world_size: int, capabilities: dict[str, Any] | None = None) -> int:
    """The GPUs a cell's job asks for (`setting`: hardware.gpus_per_rank): every rank of a distributed cell is a
    process of the one job."""
    return world_size * gpus_per_rank(setting, capabilities)


def placed_by_cluster(env: dict[str, str] | None = None) -> bool:
    """A SLURM job sees only the GPUs it was granted: nothing to claim from its neighbours."""
    env = os.environ if env is None else env
    return bool(env.get("SLURM_JOB_ID"))


@contextmanager
def claimed_devices(
    count: int,
    pool: list[str],
    lock_dir: Path | None = None,
    on_wait: Callable[[str], None] = print,
) -> Iterator[list[str]]:
    """`count` devices of `pool` that no other job on this machine holds, for as long as the block runs.

    Each device is an flock on its own file; the kernel releases it when the holder exits, however it ends,
    so a killed job never leaves a device claimed. Waits (polling) while too few are free."""
    lock_dir = lock_dir or Path(tempfile.gettempdir()) / f"tunegrid-gpus-{os.getuid()}"
    lock_dir.mkdir(parents=True, exist_ok=True)
    if count > len(pool):
        raise ValueError(f"asked for {count} GPUs, {len(pool)} visible ({', '.join(pool) or 'none'})")
    held: list[tuple[str, int]] = []
    announced = False
    try:
        while True:
            for device in pool:
                if len(held) == count:
                    break
                if any(device == name for name, _ in held):
                    continue
                fd = os.open(lock_dir / f"gpu-{re.sub(r'[^A-Za-z0-9_.-]', '_', device)}.lock", os.O_CREAT | os.O_RDWR)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                held.append((device, fd))
            if len(held) == count:
                break
            for _, fd in held:  # never sit on some devices while waiting for others: no deadlock between jobs
                os.close(fd)
            held = []
            if not announced:
                on_wait(f"waiting for {count} free GPU(s) of {', '.join(pool)} (held by other cells' jobs)")
                announced = True
            time.sleep(CLAIM_POLL_S)
        yield [device for device, _ in held]
    finally:
        for _, fd in held:
            os.close(fd)


@contextmanager
def cell_devices(
    setting: str | int, world_size: int, capabilities: dict[str, Any], lock_dir: Path | None = None
) -> Iterator[str | None]:
    """CUDA_VISIBLE_DEVICES for a cell's ranks while it trains (`setting`: hardware.gpus_per_rank): "" (CPU) where it
    asks for no GPU, its own claimed devices on a local machine, None (as granted) in a cluster job or on a machine
    without CUDA."""
    count = cell_gpus(setting, world_size, capabilities)
    if count == 0:
        yield ""
        return
    if placed_by_cluster() or capabilities.get("device") != "cuda":
        yield None
        return
    listed = os.environ.get(VISIBLE_ENV)
    pool = device_list(listed) if listed is not None else [str(i) for i in range(len(capabilities.get("gpus") or []))]
    with claimed_devices(count, pool, lock_dir) as devices:
        yield ",".join(devices)
