"""A content-addressed cache of dequantized GGUF checkpoints, shared by every study of the user, as the Hugging
Face hub cache is: dequantizing is the expensive part of a `gguf` model (about 45 CPU-s for Gemma 3 270M, minutes
for bigger models), and what it writes depends only on the GGUF file and on the code that unpacks it, never on
the study or the model's name in it.

    <cache>/gguf/<key>/entry.json   what the key is the hash of, the size and sha256 of every file below, and the
                                    facts measured at fill (the GGUF's own description, the tokenizer's footprint)
    <cache>/gguf/<key>/model/       the folder transformers wrote: weights, config, tokenizer (no licence files)

<cache> is $TUNEGRID_CACHE, else ${XDG_CACHE_HOME:-~/.cache}/tunegrid; TUNEGRID_CACHE=off turns it off. A hit
gives the study's folder the entry's files as hard links (copies where the filesystems differ), never symlinks:
the cache may be cleaned while results are kept. An entry is checked against its own file list on every hit, and
one that differs (corrupted, cut short) is discarded and made afresh. The cache only saves time: one that cannot
be read or written is warned about in the rule's log, and the checkpoint is made without it.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunegrid.manifest import sha256_file
from tunegrid.runtime.cache import CACHE_ENV, OFF, cache_root, warn  # noqa: F401 — the cache's words, read here too
from tunegrid.runtime.files import current_umask, open_to_umask

# Bump when dequantize_to changes what it writes (a dtype, a file, a config key it drops): every older entry then
# has another key and is never read again.
FORMAT = 1
# The packages whose code writes the folder: transformers unpacks the blocks and saves it, gguf reads the file,
# tokenizers serializes tokenizer.json. torch and numpy only carry the values (the unpacking is exact arithmetic).
KEY_PACKAGES = ("transformers", "gguf", "tokenizers")
ENTRY_FILE = "entry.json"
MODEL_DIR = "model"


def key_versions() -> dict[str, str]:
    """The installed versions of the packages that write the folder."""
    return {name: importlib.metadata.version(name) for name in KEY_PACKAGES}


def identity(gguf_sha256: str) -> dict[str, Any]:
    """Everything the dequantized folder depends on; the entry's key is its hash."""
    return {"format": FORMAT, "gguf_sha256": gguf_sha256, "versions": key_versions()}


@dataclass(frozen=True)
class CacheEntry:
    """One GGUF's entry: where it is (None with the cache off) and what its key is the hash of."""

    path: Path | None
    identity: dict[str, Any]

    @classmethod
    def of(cls, gguf_sha256: str) -> CacheEntry:
        which = identity(gguf_sha256)
        key = hashlib.sha256(json.dumps(which, sort_keys=True).encode()).hexdigest()[:32]
        root = cache_root()
        return cls(root / "gguf" / key if root else None, which)

    def note(self, hit: bool, filled: bool = False) -> dict[str, Any]:
        """The manifest's `cache`: whether the weights came from the cache, and which entry."""
        if self.path is None:
            return {"hit": False, "entry": None, "off": f"{CACHE_ENV}={OFF}"}
        return {"hit": hit, "entry": str(self.path), **({} if hit else {"filled": filled})}


def take(entry: CacheEntry, out_dir: Path, needs: tuple[str, ...] = ()) -> dict[str, Any] | None:
    """On a hit, the entry's files placed in `out_dir` and the facts it was filled with (holding `needs`); None on a
    miss, or for an entry discarded as damaged."""
    if entry.path is None or not entry.path.exists():
        return None
    try:
        record = json.loads((entry.path / ENTRY_FILE).read_text())
        problem = _damage(entry, record, needs)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # unreadable, or not our JSON
        problem = f"its {ENTRY_FILE} cannot be read ({type(exc).__name__}: {str(exc)[:200]})"
    if problem:
        warn(f"entry {entry.path} is damaged ({problem}); discarding it and dequantizing afresh")
        discard(entry.path)
        return None
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for rel in record["files"]:
            place(entry.path / MODEL_DIR / rel, out_dir / rel)
    except OSError as exc:  # the entry went away meanwhile (cleaned, discarded by another study), or a full disk
        warn(f"cannot take {entry.path} ({exc}); dequantizing afresh")
        return None
    return record["facts"]


def _damage(entry: CacheEntry, record: dict[str, Any], needs: tuple[str, ...]) -> str | None:
    """What differs between the entry and the file list it was filled with; None when nothing does."""
    assert entry.path is not None
    if record["identity"] != entry.identity:
        return f"it was filled for {record['identity']}, its key says {entry.identity}"
    if not isinstance(record["facts"], dict) or set(needs) - set(record["facts"]):
        return f"its facts lack {sorted(set(needs) - set(record['facts']))}"
    if not record["files"]:
        return "it lists no file"
    for rel, fact in record["files"].items():
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            return f"it lists {rel!r}, outside its folder"
        path = entry.path / MODEL_DIR / rel
        if not path.is_file():
            return f"{rel} is missing"
        if path.stat().st_size != fact["bytes"]:
            return f"{rel} has {path.stat().st_size} bytes, not {fact['bytes']}"
        if sha256_file(path) != fact["sha256"]:
            return f"{rel} does not match its sha256"
    return None


def place(source: Path, target: Path) -> None:
    """`target` as a hard link to `source`, or a copy across filesystems; never written into: an existing target
    is replaced (renamed over), so a link into the cache is never truncated by a later write."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
    try:
        try:
            os.link(source, staged)
        except OSError:  # another filesystem, or one without hard links
            shutil.copyfile(source, staged)
        os.replace(staged, target)
    finally:
        staged.unlink(missing_ok=True)


def fill(entry: CacheEntry, folder: Path, facts: dict[str, Any]) -> bool:
    """The entry made from a freshly dequantized `folder` and the facts measured on it (what a hit gives back
    instead of measuring them again): written in a temporary folder inside the cache, then renamed into place, so
    it is whole or absent. Two studies filling the same key at once: the first rename wins and the other discards
    its copy. Whether the entry is there afterwards."""
    if entry.path is None:
        return False
    try:
        entry.path.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=entry.path.parent, prefix=f".fill-{entry.path.name}-"))
    except OSError as exc:  # read-only, full, or not a folder
        warn(f"cannot write {entry.path.parent} ({exc}); the checkpoint is made without caching it")
        return False
    try:
        files = {}
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            rel = path.relative_to(folder).as_posix()
            place(path, staging / MODEL_DIR / rel)
            files[rel] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
        made = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        record = {"identity": entry.identity, "files": files, "facts": facts, "filled_at": made}
        (staging / ENTRY_FILE).write_text(json.dumps(record, indent=1, sort_keys=True))
        open_to_umask(staging)  # mkdtemp's 0700 and safetensors' 0600, opened as the user's own files are
        staging.chmod(0o777 & ~current_umask())
        os.rename(staging, entry.path)
        return True
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST) and entry.path.is_dir():
            return True  # another study filled it first: its copy is as good as this one
        warn(f"cannot fill {entry.path} ({exc}); the checkpoint is made without caching it")
        return False
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def discard(path: Path) -> None:
    """Remove a damaged entry: renamed aside first (one step), so no study takes it half-removed."""
    aside = path.with_name(f".discard-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return  # another study discarded it first
    except OSError as exc:
        warn(f"cannot discard {path} ({exc}); remove it by hand")
        return
    shutil.rmtree(aside, ignore_errors=True)
