"""How a cell's worker process starts, which decides the CPU memory it begins with.

`spawned`: a fresh Python process that imports torch, transformers, peft and bitsandbytes itself. `forked`: a
child of the invocation's warm worker (tunegrid.run.warm), which inherits those imports. On CPU the two start
from different resident sets (a fork maps the parent's libraries lazily, so it starts lower and grows as it
touches them), so the memory estimate takes the probe's constant for the path the cell takes.

Light module: standard library only (the Snakefile and the plan rules read it).
"""

from __future__ import annotations

SPAWNED = "spawned"
FORKED = "forked"
WORKERS = (SPAWNED, FORKED)
# the environment variable through which a snakemake invocation's jobs find its warm worker's socket
WARM_SOCKET_ENV = "TUNEGRID_WARM_SOCKET"
# and its warm supervisor's, which forks each `finetune` job's supervisor (tunegrid.run.warm_jobs)
WARM_SUPERVISOR_SOCKET_ENV = "TUNEGRID_WARM_SUPERVISOR_SOCKET"


def planned_worker(device: str, warm_worker: bool, nodes: int, stack_python: str) -> str:
    """The path a cell's workers will take: forked where the run has a warm worker (`warm_worker`: a local run of
    a study with `execution.warm_worker`) and the cell trains on the CPU, each of its ranks a child of the warm
    worker (which never serves where a GPU is visible); spawned otherwise. The supervisor spawns if the warm
    worker does not answer; result.json records the path taken. A cell on a library stack of its own
    (`stack_python`: its interpreter, "" on the base stack) is always spawned, by that interpreter: the warm worker
    has the base's libraries imported. A cell across nodes (`nodes` > 1) is spawned: each rank is a SLURM step on
    its node (tunegrid.run.nodes). The cell's facts come as values: the runtime knows no word of a study (no
    CellSpec)."""
    forkable = warm_worker and device == "cpu" and not stack_python and nodes <= 1
    return FORKED if forkable else SPAWNED
