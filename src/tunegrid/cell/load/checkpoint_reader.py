"""Checkpoint tensors read with pread into private memory, one at a time, with no file mapping at all.

A mapped safetensors file keeps its pages resident in the process (counted in its RSS and peak) until
it is closed, i.e. the whole checkpoint for the length of a load; and safetensors' own pread backend
still maps each file while opening it, which under an address-space budget (RLIMIT_AS) charges the
whole file at once. Here the header is parsed from its first bytes and each tensor's bytes are read
straight into a fresh tensor when the loader asks for it (transformers reads a lazy slice with
`slice[...]`), so a tensor is resident only from its read until the loader frees it.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

# safetensors dtype names (its format specification) -> torch dtype attribute names
DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


class PreadTensor:
    """One checkpoint tensor, unread: `tensor[...]` reads it whole; shape and dtype without reading."""

    def __init__(self, path: Path, dtype: str, shape: list[int], start: int, end: int) -> None:
        self.path, self.dtype, self.shape, self.start, self.end = path, dtype, shape, start, end

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return self.dtype

    def __getitem__(self, index: Any) -> Any:
        import torch

        if index is not Ellipsis:
            raise TypeError("only the whole tensor is read: use tensor[...]")
        value = torch.empty(self.shape, dtype=getattr(torch, DTYPES[self.dtype]))
        buffer = memoryview(value.view(-1).view(torch.uint8).numpy()) if value.numel() else memoryview(b"")
        fd = os.open(self.path, os.O_RDONLY)
        try:
            done = 0
            while done < len(buffer):
                read = os.preadv(fd, [buffer[done:]], self.start + done)
                if read <= 0:
                    raise OSError(f"{self.path}: truncated at byte {self.start + done}")
                done += read
        finally:
            os.close(fd)
        return value


def read_header(path: Path) -> dict[str, PreadTensor]:
    """The tensors of one safetensors file, from its header (8-byte little-endian length, then JSON)."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    base = 8 + length
    return {
        name: PreadTensor(
            path, fact["dtype"], fact["shape"], base + fact["data_offsets"][0], base + fact["data_offsets"][1]
        )
        for name, fact in header.items()
    }


def unread_state_dict(model_dir: Path) -> dict[str, PreadTensor]:
    """Every checkpoint tensor of the folder's *.safetensors files, unread."""
    tensors: dict[str, PreadTensor] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(read_header(path))
    return tensors
