"""Activation offloading (`train.activation_offloading`): every tensor autograd saves for backward during a
micro-batch's forward is copied to host memory (pinned on CUDA) and copied back when the backward needs it,
so the device holds the activations of the layer being computed rather than of all of them.

The same trade as torch.autograd.graph.save_on_cpu and axolotl's `activation_offloading` (torchtune's
OffloadActivations): parameters stay where they are (autograd saves the weight itself, not a copy), and so
do tensors under `MIN_BYTES`, whose copies cost more than they free. With activation checkpointing on, the
checkpoint's saved inputs (each layer's input, saved by torch's non-reentrant checkpoint before the layer runs)
go to host memory too: axolotl's `gradient_checkpointing: offload`. On a CPU cell the activations already
live in host memory: nothing moves, and the peak is the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from tunegrid.cell_spec import CellSpec

MIN_BYTES = 1024  # torchtune's min_offload_size


class ActivationOffload:
    """The saved-tensor hooks of one cell, and how many bytes they moved to host memory (the last step's)."""

    def __init__(self, device: Any) -> None:
        self.device_type = getattr(device, "type", str(device))
        self.moved_bytes = 0

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        import torch

        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield

    def pack(self, tensor: Any) -> Any:
        import torch

        size = tensor.numel() * tensor.element_size()
        if tensor.device.type == "cpu" or isinstance(tensor, torch.nn.Parameter) or size < MIN_BYTES:
            return tensor
        if tensor.layout != torch.strided:
            return tensor
        # as save_on_cpu packs: a contiguous host tensor of the same size (a view's strides are not kept)
        host = torch.empty(tensor.size(), dtype=tensor.dtype, pin_memory=self.device_type == "cuda")
        host.copy_(tensor)
        self.moved_bytes += size
        return (tensor.device, host)

    @staticmethod
    def unpack(packed: Any) -> Any:
        if isinstance(packed, tuple):
            device, host = packed
            return host.to(device, non_blocking=True)
        return packed


def offload_of(spec: CellSpec, device: Any) -> ActivationOffload | None:
    """The cell's offloading hooks where `train.activation_offloading` is on."""
    return ActivationOffload(device) if spec.train.activation_offloading else None
