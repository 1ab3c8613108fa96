"""A checkpoint folder's manifest (manifest.json: the source, and the size and sha256 of every file), checked
before a load: by the checkpoint rule that writes it (tunegrid.prepare.checkpoints) and by the cell's worker that
loads the folder.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from tunegrid.runtime.files import read_json


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be produced or trusted; the message says why and what to do."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def verify_checkpoint(model_dir: str | Path, *, hashes: bool = False) -> dict[str, Any]:
    """Check the folder against its manifest before loading; sizes always, sha256 when asked."""
    model_dir = Path(model_dir)
    manifest_path = model_dir / "manifest.json"
    if not manifest_path.is_file():
        raise CheckpointError(f"{model_dir}: no manifest.json; rebuild it with the checkpoint rule")
    manifest = read_json(manifest_path)
    for name, fact in manifest["files"].items():
        path = model_dir / name
        if not path.exists():
            raise CheckpointError(f"{model_dir}: {name} listed in manifest.json is missing; re-run the checkpoint rule")
        size = path.resolve().stat().st_size
        if size != fact["bytes"]:
            raise CheckpointError(
                f"{model_dir}: {name} has {size} bytes, manifest says {fact['bytes']} (truncated or replaced?)"
            )
        if hashes and sha256_file(path.resolve()) != fact["sha256"]:
            raise CheckpointError(f"{model_dir}: {name} does not match its sha256 in manifest.json")
    if not any(name.endswith(".safetensors") for name in manifest["files"]):
        raise CheckpointError(f"{model_dir}: no *.safetensors weights; tunegrid loads safetensors only")
    return manifest
