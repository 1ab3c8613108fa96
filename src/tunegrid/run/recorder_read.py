"""The flight recorder's dumps read as data. Run in a process of its own with the cell's Python
(`python -m tunegrid.run.recorder_read <folder> --world N`): it imports PyTorch's own reader
(torch.distributed.flight_recorder.components: the loader's dump format, the builder that pairs each rank's
entries into collectives) and prints one JSON document, the reading, whatever the dumps hold; it never fails
itself. The supervisor reads that document (rank_diagnosis.analyze_flight_recorder; diagnosis.RecorderReading).

The reading's `status`, and what each may decide:
- `found`: every rank left a readable dump and a collective failed: `first` names its process group, collective,
  sequence number, the ranks that did not join it and the mismatch type (None: ranks missing, no mismatch).
- `none_failed`: every collective the dumps hold paired up.
- `incomplete`: ranks left no readable dump (`ranks_without_dumps`): the collectives they were in cannot be
  told; a rank that did not arrive often leaves none. Their names are evidence, never a mismatch.
- `too_many_mismatches`: PyTorch's builder stopped pairing a process group ("Too many mismatches ... aborting");
  what it found before is kept, marked, never a verdict.
- `no_dumps`: no dump in the folder; `failed`: the reader raised (`note` says what).

Dumps are picked by name: a file whose name ends in the rank (`rank_3`, `_dump_3`, `nccl_trace_rank_3`,
`host-a_dump_3`); the prefix is whatever comes before it, so host names or mixed prefixes read the same, and
other files (`rank_0.pipe`, `.bak`, logs) are left out and listed in `ignored`.
"""

from __future__ import annotations

import argparse
import json
import logging
import pickle
import re
import sys
from pathlib import Path
from typing import Any

STATUSES = ("found", "none_failed", "incomplete", "too_many_mismatches", "no_dumps", "failed")
DUMP_RE = re.compile(r"^(?P<prefix>[\w.\-]*?[A-Za-z_\-])(?P<rank>\d+)$")
MISMATCH_CAP = 1000  # PyTorch's builder stops pairing a group after this many (its command line's default: 10)
LISTED = 20  # failing collectives kept beside the first, one per process group


def dump_files(folder: Path) -> tuple[dict[int, Path], list[str]]:
    """rank -> its dump file, and the names left out (not a regular file, no rank at the end, a second file for
    a rank already found)."""
    dumps: dict[int, Path] = {}
    ignored = []
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        found = DUMP_RE.match(path.name)
        if not found or not path.is_file() or int(found["rank"]) in dumps:
            ignored.append(path.name)
            continue
        dumps[int(found["rank"])] = path
    return dumps, ignored


def _load(dumps: dict[int, Path]) -> tuple[dict[str, dict[str, Any]], dict[int, str]]:
    """The loader's `details` (PyTorch's read_dump, with our own rank), and the ranks whose file did not read."""
    details, unreadable = {}, {}
    for rank, path in sorted(dumps.items()):
        try:
            with path.open("rb") as infile:
                dump = pickle.load(infile)
            details[path.name] = {
                "host_name": f"host_rank{rank}",
                "rank": rank,
                "entries": dump["entries"],
                "version": dump["version"],
                "pg_config": dump["pg_config"],
            }
        except Exception as exc:  # noqa: BLE001 - a truncated, empty or foreign file is one rank without a dump
            unreadable[rank] = f"{type(exc).__name__}: {exc}"[:200]
    return details, unreadable


def _name_unnamed_groups(details: dict[str, dict[str, Any]]) -> bool:
    """Gloo's dumps (torch 2.13) name their process group '' in pg_config while the entries name it ('0',
    'default_pg'); the builder then fails (KeyError). With one group on each side, name it from the entries."""
    renamed = False
    for dump in details.values():
        config = dump["pg_config"]
        named = {tuple(e["process_group"]) for e in dump["entries"] if e.get("process_group")}
        if set(config) == {""} and len(named) == 1:
            name, desc = next(iter(named))
            config[name] = {**config.pop(""), "name": name, "desc": desc}
            renamed = True
    return renamed


def _collective(c: Any) -> dict[str, Any]:
    mismatch = getattr(c, "type_of_mismatch", None)
    return {
        "group": str(c.group_id),
        "group_desc": str(c.pg_desc),
        "collective": str(c.collective_name),
        "seq": int(c.collective_seq_id),
        "missing_ranks": sorted(c.missing_ranks) if c.missing_ranks else [],
        "expected_ranks": sorted(c.expected_ranks or []),
        "state": str(c.collective_state),
        "mismatch": mismatch.state.name if mismatch is not None and hasattr(mismatch, "state") else None,
        "mismatch_detail": str(mismatch) if mismatch is not None else None,
    }


class _Aborts(logging.Handler):
    """PyTorch's builder only logs "Too many mismatches for process_group ... aborting" and returns."""

    def __init__(self) -> None:
        super().__init__()
        self.aborted: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Too many mismatches"):
            self.aborted.append(message[:300])


def read(folder: Path, world: int | None = None, mismatch_cap: int = MISMATCH_CAP) -> dict[str, Any]:
    """The reading (see the module's docstring); `world` the cell's ranks, so a rank with no file is named."""
    dumps, ignored = dump_files(folder)
    reading: dict[str, Any] = {
        "status": "no_dumps",
        "dumps": {str(rank): path.name for rank, path in sorted(dumps.items())},
        "ignored": ignored,
        "first": None,
        "failing_groups": [],
        "failing_collectives": 0,
        "ranks_without_dumps": [],
        "empty_dumps": [],
        "note": "",
    }
    if not dumps:
        reading["note"] = f"no dump file in {folder}" + (f" (left out: {', '.join(ignored)})" if ignored else "")
        return reading
    try:
        _analyse(reading, dumps, world, mismatch_cap)
    except Exception as exc:  # noqa: BLE001 - the reader reports, never decides by crashing
        reading.update(status="failed", note=f"{type(exc).__name__}: {exc}"[:400], first=None, failing_groups=[])
    return reading


def _analyse(reading: dict[str, Any], dumps: dict[int, Path], world: int | None, mismatch_cap: int) -> None:
    from torch.distributed.flight_recorder.components.builder import build_db

    details, unreadable = _load(dumps)
    notes = [f"rank {rank}'s dump did not read ({why})" for rank, why in unreadable.items()]
    if not details:
        reading.update(status="failed", note="; ".join(notes))
        return
    if _name_unnamed_groups(details):
        notes.append("process groups unnamed in pg_config (gloo) were named from the entries")
    reading["empty_dumps"] = sorted(d["rank"] for d in details.values() if not d["entries"])
    version = str(next(iter(details.values()))["version"])
    logger = logging.getLogger("Flight Recorder")
    aborts = _Aborts()
    logger.addHandler(aborts)
    logger.propagate = False
    for handler in logger.handlers:
        if handler is not aborts:
            handler.setLevel(logging.CRITICAL + 1)  # its own stderr handler: the reading is the output
    args = argparse.Namespace(
        verbose=False, just_print_entries=False, allow_incomplete_ranks=True, mismatch_cap=mismatch_cap
    )
    db = build_db(details, args, version)
    read_ranks = {d["rank"] for d in details.values()}
    expected = set(range(world)) if world else set()
    for member in db.memberships:
        expected.add(int(member.global_rank))
    without = sorted(expected - read_ranks)
    failing = [c for c in db.collectives if c.missing_ranks or not c.pass_check]
    collectives = [_collective(c) for c in failing]
    for c in collectives:  # with dumps missing the builder leaves missing_ranks None: the expected without a dump
        if not c["missing_ranks"] and c["mismatch"] in (None, "FULLY_MATCHED", "UNDECIDED"):
            c["missing_ranks"] = sorted(set(c["expected_ranks"]) - read_ranks)
    groups: dict[str, dict[str, Any]] = {}
    for c in collectives:
        groups.setdefault(c["group"], c)
    if aborts.aborted:
        notes.append("; ".join(aborts.aborted[:3]))
    status = (
        "incomplete"
        if without
        else "too_many_mismatches"
        if aborts.aborted
        else "found"
        if collectives
        else "none_failed"
    )
    reading.update(
        status=status,
        version=version,
        first=collectives[0] if collectives else None,
        failing_groups=list(groups.values())[:LISTED],
        failing_collectives=len(collectives),
        ranks_without_dumps=without,
        note="; ".join(notes),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--world", type=int, default=None)
    parser.add_argument("--mismatch-cap", type=int, default=MISMATCH_CAP)
    args = parser.parse_args(argv)
    try:
        reading = read(args.folder, args.world, args.mismatch_cap)
    except Exception as exc:  # noqa: BLE001 - even an unreadable folder is a reading
        reading = {"status": "failed", "note": f"{type(exc).__name__}: {exc}"[:400]}
    print(json.dumps(reading, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
