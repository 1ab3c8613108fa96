"""Atomic file writes and JSON/JSONL helpers: a reader never sees a half-written result."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any


def write_text_if_changed(path: str | Path, text: str) -> bool:
    """Write only when the content differs, so the file's mtime says when it last changed."""
    path = Path(path)
    if path.is_file() and path.read_text() == text:
        return False
    atomic_write_text(path, text)
    return True


def current_umask() -> int:
    """The process's umask (reading it means setting it, so it is set back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def open_to_umask(folder: str | Path) -> None:
    """Files a library wrote private in `folder` (safetensors' writer makes every file 0600, whatever the umask)
    opened to the user's umask, as tunegrid's own writes are. Links are left alone: they point at the user's files."""
    import stat

    mode = 0o666 & ~current_umask()
    for path in Path(folder).rglob("*"):
        if not path.is_symlink() and path.is_file() and stat.S_IMODE(path.stat().st_mode) == 0o600 != mode:
            path.chmod(mode)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write to a temp file in the same folder, fsync, then rename over the target.

    mkstemp makes its file 0600 whatever the umask; the result is opened to the user's umask before the rename
    (0644 under the usual 022, group-readable under 002), as a plain open() would have made it, so a team member
    can read a report on a shared machine. Nothing tunegrid writes holds a secret."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _json_safe(value: Any) -> Any:
    """NaN/inf are facts we record (a NaN loss is the point), but JSON has no literal for them."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def dumps(obj: Any, indent: int | None = 2) -> str:
    return json.dumps(_json_safe(obj), indent=indent, sort_keys=True, default=str)


def write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, dumps(obj) + "\n")


def read_json(path: str | Path) -> Any:
    with open(path) as fh:
        return json.load(fh)


class JsonlAppender:
    """Append-only JSONL, one flush per line, so a crash keeps every line written before it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(dumps(record, indent=None) + "\n")

    def close(self) -> None:
        self._fh.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every complete line; a torn last line (the writer was killed mid-write) is skipped."""
    records = []
    path = Path(path)
    if not path.exists():
        return records
    with open(path) as fh:
        for line in fh:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records
