"""The run-folder contract: which files a cell's run folder holds, how they are read while it trains,
and what a re-run clears. The worker writes them, the supervisor reads them, the review reads them after.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

# The resume state's folder (checkpoint/, tunegrid.cell.loop.resume) is deliberately not a run file: a re-run resumes
# from it, and the worker itself removes one written for a different training spec.
RUN_FILES = (
    "metrics.jsonl",
    "events.jsonl",
    "headroom.jsonl",
    "audit.json",
    "worker.json",
    "heartbeat",
    "ranks",
    "flight_recorder",
    "adapter",
)


class MetricsTail:
    """Reads complete new lines of a growing JSONL file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def read_new(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with open(self.path) as fh:
            fh.seek(self.offset)
            chunk = fh.read()
        end = chunk.rfind("\n") + 1  # a line without its newline is still being written
        self.offset += len(chunk[:end].encode())
        records = []
        for line in chunk[:end].splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return records


def last_activity(run_dir: Path, started: float, world: int = 1) -> float:
    """The latest sign of life of any rank (a stalled collective stops them all)."""

    times = [started]
    for rank in range(world):
        for name in ("heartbeat", "metrics.jsonl"):
            path = rank_dir(run_dir, rank) / name
            if path.exists():
                times.append(path.stat().st_mtime)
    return max(times)


def clear_run_files(run_dir: Path) -> None:
    """A re-run or a retry replaces the earlier attempt's files, never appends to them."""
    for name in RUN_FILES:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def heartbeat_stage(run_dir: Path) -> str:
    path = run_dir / "heartbeat"
    return path.read_text().strip() if path.exists() else "start"


def rank_dir(run_dir: Path, rank: int) -> Path:
    """Rank 0 writes the cell's files; every other rank writes the same set under ranks/rank<r>/."""
    return run_dir if rank == 0 else run_dir / "ranks" / f"rank{rank}"


class Heartbeat:
    """A file whose mtime is the last sign of life; the supervisor reads it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    last = "start"

    def beat(self, stage: str) -> None:
        self.last = stage
        self.path.write_text(stage)

    def pulse(self, detail: str) -> None:
        """A sign of life within the current stage (which stays `last`): the stage with what is running now."""
        self.path.write_text(f"{self.last}: {detail}")
