"""What a SLURM cluster offers a cell, asked of the scheduler itself: its partitions (sinfo) and whether it keeps
accounting (sacct). The probe records the partitions when it runs as a cluster job, so that a cell the cluster
cannot schedule is `unsupported` before it is submitted (tunegrid.targets.cluster_shortfall); the workflow asks
about accounting before any job is submitted, because without it the executor's default status command
(sacct) never learns that a job ended.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import asdict, dataclass
from typing import Any

SINFO_FORMAT = "%P|%c|%m|%G|%D|%a"  # partition, CPUs per node, memory per node (MB), generic resources, nodes, state
TIMEOUT_S = 15
ACCOUNTING_DISABLED = "accounting storage is disabled"  # sacct's words on a cluster without slurmdbd


@dataclass(frozen=True)
class Partition:
    name: str
    default: bool
    cpus_per_node: int
    memory_mb_per_node: int
    gpus_per_node: int
    nodes: int
    up: bool

    def words(self) -> str:
        gpus = f", {self.gpus_per_node} GPUs" if self.gpus_per_node else ", no GPUs"
        return f"{self.name}: {self.nodes} node(s) of {self.cpus_per_node} CPUs{gpus}, {self.memory_mb_per_node} MB"


def _count(text: str) -> int:
    """sinfo's figure for a group of nodes: `8`, or `8+` where the group's nodes differ (the smallest)."""
    found = re.match(r"\d+", text.strip())
    return int(found.group()) if found else 0


def _gpus(gres: str) -> int:
    """GPUs per node in sinfo's %G: `gpu:3`, `gpu:a100:4(S:0-1)`, `gpu:a100:4,shard:8`, or `(null)`."""
    total = 0
    for item in gres.split(","):
        parts = re.sub(r"\(.*?\)", "", item).split(":")
        if parts[0] == "gpu" and len(parts) > 1 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def parse_sinfo(text: str) -> list[Partition]:
    """`sinfo -h -e -o SINFO_FORMAT`'s lines (one per group of alike nodes of a partition)."""
    found = []
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 6:
            continue
        name, cpus, memory, gres, nodes, state = fields
        found.append(
            Partition(
                name=name.rstrip("*"),
                default=name.endswith("*"),
                cpus_per_node=_count(cpus),
                memory_mb_per_node=_count(memory),
                gpus_per_node=_gpus(gres),
                nodes=_count(nodes),
                up=state.strip() == "up",
            )
        )
    return found


def slurm_partitions() -> list[dict[str, Any]] | None:
    """The cluster's partitions as the probe records them, or None where sinfo is not there or does not answer."""
    if shutil.which("sinfo") is None:
        return None
    try:
        done = subprocess.run(
            ["sinfo", "-h", "-e", "-o", SINFO_FORMAT], capture_output=True, text=True, timeout=TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return [asdict(p) for p in parse_sinfo(done.stdout)]


def accounting_disabled() -> str | None:
    """sacct's own words where this cluster keeps no job accounting (no slurmdbd), else None (sacct answers,
    or is not there at all)."""
    if shutil.which("sacct") is None:
        return None
    try:
        done = subprocess.run(
            ["sacct", "--noheader", "-X", "--starttime", "now", "--format", "JobID"],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"sacct did not answer ({exc})"
    if done.returncode == 0:
        return None
    return (done.stderr or done.stdout).strip().splitlines()[-1] if (done.stderr or done.stdout).strip() else "failed"
