"""The cache of dequantized GGUF checkpoints (prepare/gguf_cache.py), on a tiny GGUF written by the `gguf` package's
own writer (test_gguf_source.py): the second study of a file takes the first one's folder without dequantizing it
again, file for file the same; a damaged entry is noticed, discarded and made afresh; a cache that cannot be
written never fails the study; the key follows the code that writes the folder, not the study."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest

from tunegrid.cell.adapters import base_model_identity
from tunegrid.manifest import verify_checkpoint
from tunegrid.prepare import gguf_cache, gguf_checkpoint
from tunegrid.prepare.checkpoints import produce_checkpoint
from tunegrid.prepare.gguf_cache import ENTRY_FILE, MODEL_DIR, CacheEntry, fill

pytest.importorskip("gguf", reason="the gguf source needs the gguf package (envs/requirements-real.txt)")


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_gguf_source import write_tiny_gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.Q4_0.gguf"
    write_tiny_gguf(path, "llama")
    return path


@pytest.fixture
def dequantized(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The folders transformers dequantized into during the test (each call of dequantize_to)."""
    calls: list[Path] = []
    real = gguf_checkpoint.dequantize_to

    def counted(gguf_path: Path, out_dir: Path, key: str) -> None:
        calls.append(out_dir)
        real(gguf_path, out_dir, key)

    monkeypatch.setattr(gguf_checkpoint, "dequantize_to", counted)
    return calls


def make(gguf: Path, out: Path) -> dict:
    return produce_checkpoint({"source": "gguf", "path": str(gguf), "package": "", "sha256": ""}, [], out)


@pytest.fixture(scope="module")
def filled(tiny_file: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A cache holding the tiny file's entry, and the manifest of the study that filled it (a miss)."""
    cache = tmp_path_factory.mktemp("filled-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TUNEGRID_CACHE", str(cache))
        manifest = make(tiny_file, tmp_path_factory.mktemp("first") / "models" / "tiny")
    return cache, manifest


def own_cache(filled: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the filled cache for this test alone (its own inodes: damaging it damages no other test's)."""
    cache = tmp_path / "cache"
    shutil.copytree(filled[0], cache)
    monkeypatch.setenv("TUNEGRID_CACHE", str(cache))
    return cache


def test_a_second_study_of_the_same_gguf_takes_the_cached_folder(tiny_file, dequantized, tmp_path, monkeypatch):
    monkeypatch.setenv("TUNEGRID_CACHE", str(tmp_path / "cache"))
    first = make(tiny_file, tmp_path / "study-a" / "models" / "tiny")
    assert len(dequantized) == 1 and first["cache"]["hit"] is False and first["cache"]["filled"] is True
    entry = Path(first["cache"]["entry"])
    assert entry.parent == tmp_path / "cache" / "gguf" and (entry / ENTRY_FILE).is_file()

    monkeypatch.setattr(gguf_checkpoint, "gguf_facts", lambda path: pytest.fail("read the GGUF again"))
    second_dir = tmp_path / "study-b" / "models" / "another-name"  # the key is the file's, not the study's
    second = make(tiny_file, second_dir)
    assert len(dequantized) == 1  # not dequantized again, nor its facts read again: the entry holds them
    assert second["cache"] == {"hit": True, "entry": str(entry)}
    assert second["files"] == first["files"] and second["source"] == first["source"]
    assert base_model_identity(second) == base_model_identity(first)  # an adapter keeps its base either way
    verify_checkpoint(second_dir, hashes=True)
    weights = second_dir / "model.safetensors"
    assert not weights.is_symlink()  # the cache may be cleaned while results are kept
    assert weights.stat().st_ino == (entry / MODEL_DIR / "model.safetensors").stat().st_ino  # a hard link

    shutil.rmtree(tmp_path / "cache")  # cleaned: the study's folder still holds its files
    verify_checkpoint(second_dir, hashes=True)


def damage_flipped(model: Path) -> None:
    with open(model / "model.safetensors", "r+b") as fh:  # same size, other bytes: only the sha256 tells
        fh.seek(-8, os.SEEK_END)
        fh.write(b"\xff" * 8)


def damage_missing(model: Path) -> None:
    (model / "tokenizer.json").unlink()


def damage_entry(model: Path) -> None:
    (model.parent / ENTRY_FILE).write_text('{"facts": ')  # a write cut short


def damage_facts(model: Path) -> None:
    record = json.loads((model.parent / ENTRY_FILE).read_text())
    del record["facts"]["gguf"]  # valid JSON, its files intact, but not what the manifest needs
    (model.parent / ENTRY_FILE).write_text(json.dumps(record))


DAMAGES = [damage_flipped, damage_missing, damage_entry, damage_facts]


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda d: d.__name__[7:])
def test_a_damaged_entry_is_discarded_and_made_afresh(filled, damage, dequantized, tmp_path, monkeypatch, capsys):
    cache = own_cache(filled, tmp_path, monkeypatch)
    (entry,) = (cache / "gguf").iterdir()
    damage(entry / MODEL_DIR)
    manifest = make(Path(filled[1]["source"]["path"]), tmp_path / "models" / "tiny")
    assert len(dequantized) == 1 and "is damaged" in capsys.readouterr().err
    assert manifest["files"] == filled[1]["files"]  # the folder a fresh dequantization writes
    assert manifest["cache"] == {"hit": False, "entry": str(entry), "filled": True}
    assert [p.name for p in (cache / "gguf").iterdir()] == [entry.name]  # no staging or discarded folder left
    assert make(Path(filled[1]["source"]["path"]), tmp_path / "again" / "tiny")["cache"]["hit"] is True
    assert len(dequantized) == 1


def refuse(code: int, after: int = 0):
    """A stand-in for gguf_cache.place that raises OSError(code) from its call number `after` on: a file system
    that is read-only, or fills up half-way through an entry (as root, chmod cannot make a folder read-only)."""
    calls = []
    real = gguf_cache.place

    def place(source: Path, target: Path) -> None:
        calls.append(target)
        if len(calls) > after:
            raise OSError(code, os.strerror(code), str(target))
        real(source, target)

    return place


@pytest.mark.parametrize("how", ["read-only folder", "read-only file system", "full disk", "not a folder"])
def test_a_cache_that_cannot_be_written_still_gives_the_checkpoint(tiny_file, how, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    if how == "read-only folder":
        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only folder")
        cache.mkdir(mode=0o555)
    elif how == "not a folder":
        cache.write_text("a file where the cache folder would be")
    elif how == "read-only file system":
        monkeypatch.setattr(gguf_cache, "place", refuse(errno.EROFS))
    else:  # the third file of the entry does not fit
        monkeypatch.setattr(gguf_cache, "place", refuse(errno.ENOSPC, after=2))
    monkeypatch.setenv("TUNEGRID_CACHE", str(cache))
    out = tmp_path / "models" / "tiny"
    try:
        manifest = make(tiny_file, out)
    finally:
        cache.chmod(0o755)
    assert manifest["cache"]["hit"] is False and manifest["cache"]["filled"] is False
    assert "warning: tunegrid cache: cannot " in capsys.readouterr().err
    verify_checkpoint(out, hashes=True)
    gguf = cache / "gguf"
    assert not gguf.is_dir() or not list(gguf.iterdir())  # nothing half-written left in the cache


def test_a_read_only_cache_still_gives_its_entries(filled, dequantized, tmp_path, monkeypatch):
    cache = own_cache(filled, tmp_path, monkeypatch)
    folders = [cache, *(p for p in cache.rglob("*") if p.is_dir())]
    for folder in folders:
        folder.chmod(0o555)
    try:
        manifest = make(Path(filled[1]["source"]["path"]), tmp_path / "models" / "tiny")
    finally:
        for folder in folders:
            folder.chmod(0o755)
    assert manifest["cache"]["hit"] is True and not dequantized
    assert manifest["files"] == filled[1]["files"]


def test_the_key_follows_the_versions_that_write_the_folder(filled, dequantized, tmp_path, monkeypatch):
    cache = own_cache(filled, tmp_path, monkeypatch)
    digest = filled[1]["source"]["gguf_sha256"]
    before = CacheEntry.of(digest).path
    assert (
        before is not None and before.name == Path(filled[1]["cache"]["entry"]).name and before.parent.parent == cache
    )
    installed = gguf_cache.key_versions()
    monkeypatch.setattr(gguf_cache, "key_versions", lambda: {**installed, "transformers": "99.0.0"})
    after = CacheEntry.of(digest).path
    assert after != before and after is not None and after.parent == before.parent
    manifest = make(Path(filled[1]["source"]["path"]), tmp_path / "models" / "tiny")
    assert len(dequantized) == 1 and manifest["cache"] == {"hit": False, "entry": str(after), "filled": True}
    monkeypatch.setattr(gguf_cache, "FORMAT", gguf_cache.FORMAT + 1)  # tunegrid's own unpacking changed
    assert CacheEntry.of(digest).path not in {before, after}


def test_two_studies_filling_one_key_keep_the_first_entry(filled, tmp_path, monkeypatch):
    cache = own_cache(filled, tmp_path, monkeypatch)
    entry = CacheEntry.of(filled[1]["source"]["gguf_sha256"])
    assert entry.path is not None
    before = (entry.path / ENTRY_FILE).read_text()
    folder = tmp_path / "fresh"  # what the slower study dequantized meanwhile
    shutil.copytree(entry.path / MODEL_DIR, folder)
    assert fill(entry, folder, {"gguf": {}, "tokenizer_resident_bytes": None}) is True
    assert (entry.path / ENTRY_FILE).read_text() == before  # the first entry, untouched
    assert [p.name for p in (cache / "gguf").iterdir()] == [entry.path.name]  # the loser's copy discarded


def test_the_cache_lives_where_the_environment_says_and_can_be_turned_off(
    tiny_file, dequantized, tmp_path, monkeypatch
):
    monkeypatch.delenv("TUNEGRID_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gguf_cache.cache_root() == tmp_path / "xdg" / "tunegrid"
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert gguf_cache.cache_root() == tmp_path / "home" / ".cache" / "tunegrid"
    monkeypatch.setenv("TUNEGRID_CACHE", "off")
    assert gguf_cache.cache_root() is None
    manifest = make(tiny_file, tmp_path / "models" / "tiny")
    assert manifest["cache"] == {"hit": False, "entry": None, "off": "TUNEGRID_CACHE=off"}
    assert len(dequantized) == 1 and not (tmp_path / "home").exists()
