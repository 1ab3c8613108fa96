"""What the memory estimate and the liveness limits read of a checkpoint on disk, without loading it: config.json,
every tensor's shape and the largest tensor's dtype from the safetensors headers, and the tokenizer's resident
size the manifest measured.

Light module: no torch (safetensors' header reader, numpy framework).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def numel_of(shape: list[int]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total


def tensor_shapes(model_dir: str | Path) -> dict[str, list[int]]:
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="numpy") as handle:
            for name in handle.keys():
                shapes[name] = list(handle.get_slice(name).get_shape())
    return shapes


DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U8": 1, "I8": 1, "BOOL": 1}


def largest_tensor_on_disk(model_dir: str | Path) -> tuple[int, int]:
    """(elements, bytes per element) of the checkpoint's largest tensor, from the safetensors headers."""
    from safetensors import safe_open

    largest = (0, 0)
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="numpy") as handle:
            for name in handle.keys():
                tensor = handle.get_slice(name)
                numel = numel_of(list(tensor.get_shape()))
                if numel > largest[0]:
                    largest = (numel, DTYPE_BYTES.get(tensor.get_dtype(), 4))
    return largest


def checkpoint_facts(model_dir: str | Path) -> tuple[dict[str, Any], dict[str, list[int]], dict[str, Any]]:
    """(config.json, tensor shapes, the estimate's checkpoint keywords: tokenizer_bytes, largest_on_disk and
    checkpoint_bytes, the safetensors files' size)."""
    folder = Path(model_dir)
    config = json.loads((folder / "config.json").read_text())
    manifest = folder / "manifest.json"
    tokenizer = (json.loads(manifest.read_text()).get("tokenizer_resident_bytes") or 0) if manifest.exists() else 0
    facts = {
        "tokenizer_bytes": int(tokenizer),
        "largest_on_disk": largest_tensor_on_disk(folder),
        "checkpoint_bytes": sum(path.stat().st_size for path in folder.glob("*.safetensors")),
    }
    return config, tensor_shapes(folder), facts
