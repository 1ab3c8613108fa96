"""Weight offloading (`train.weight_offloading`): each decoder layer's frozen base weights live in host memory
(pinned on CUDA) and are copied to the device for that layer's forward, and again for its backward, so the device
holds one layer's base weights at a time. It is FSDP's parameter offloading (`CPUOffload(offload_params=True)`,
axolotl's `fsdp_config.offload_params`) at one rank for the weights LoRA leaves frozen; the adapters, their
gradients and the optimizer state stay on the device.

How: FSDP's own trick. A weight keeps its tensor (autograd may have saved it for the backward, and a bitsandbytes
weight keeps its quantization state); only its storage is freed (resized to 0 bytes) after the layer's forward and
refilled from the host copy before the layer runs again: for its backward (a hook on the gradient of the layer's
output), or for the forward that activation checkpointing reruns inside the backward. The backward runs the layers
in reverse, one at a time, so a layer's turn frees every other layer's weights, and the backward's end frees the
last. Weights shared with anything outside one layer (tied, or read by two layers) stay on the device.

On a CPU cell the weights already live in host memory: nothing moves, and the cell installs nothing (the test
installs it on CPU to check the mechanism: the same loss and gradients, one layer's weights held at a time).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tunegrid.cell_spec import CellSpec
from tunegrid.sites import BLOCK_NAME


@dataclass
class _Unit:
    """One decoder layer: the storages of its frozen weights and their host copies."""

    name: str
    storages: list[Any] = field(default_factory=list)
    hosts: list[Any] = field(default_factory=list)
    nbytes: int = 0


def decoder_layers(model: Any) -> list[tuple[str, Any]]:
    """The outermost modules named as decoder blocks (model.layers.N, transformer.h.N, ...)."""
    found: list[tuple[str, Any]] = []
    for name, module in model.named_modules():
        if BLOCK_NAME.search(name) and not any(name.startswith(outer + ".") for outer, _ in found):
            found.append((name, module))
    return found


class WeightOffload:
    """The offloading hooks of one model: `install()` moves the weights to the host and hooks the layers."""

    def __init__(self, model: Any, device: Any) -> None:
        self.model = model
        self.device = device
        self.units: list[_Unit] = []
        self.live: set[int] = set()
        self.resident_bytes = 0  # offloaded weights on the device now, and the most at once (`peak_resident_bytes`)
        self.peak_resident_bytes = 0
        self.offloaded_bytes = 0  # what the host holds
        self.copied_bytes = 0  # host -> device copies so far
        self.handles: list[Any] = []
        self._queued = False

    def install(self) -> WeightOffload:
        import torch

        layers = decoder_layers(self.model)
        owners: dict[int, set[int]] = {}  # storage -> the layers (-1: outside any) whose weights use it
        inside: set[int] = set()
        for index, (_, module) in enumerate(layers):
            for param in module.parameters():
                key = param.untyped_storage().data_ptr()
                inside.add(id(param))
                if not param.requires_grad and param.device.type != "meta":
                    owners.setdefault(key, set()).add(index)
                else:
                    owners.setdefault(key, set()).add(-1)
        for param in self.model.parameters():
            if id(param) not in inside:
                owners.setdefault(param.untyped_storage().data_ptr(), set()).add(-1)
        pin = self.device.type == "cuda"
        for index, (name, module) in enumerate(layers):
            unit, shared = _Unit(name), {}
            for param in module.parameters():
                key = param.untyped_storage().data_ptr()
                if owners.get(key) == {index} and param.untyped_storage().nbytes() > 0:
                    shared.setdefault(key, []).append(param)
            for params in shared.values():
                storage = _resizable(params)
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
                host.copy_(_bytes(storage))
                unit.storages.append(storage)
                unit.hosts.append(host)
                unit.nbytes += storage.nbytes()
            self.units.append(unit)
            self.handles.append(module.register_forward_pre_hook(self._before_forward(index)))
            self.handles.append(module.register_forward_hook(self._after_forward(index)))
            self.live.add(index)
            self.resident_bytes += unit.nbytes
            self.offloaded_bytes += unit.nbytes
        for index in range(len(self.units)):
            self.free(index)
        self.peak_resident_bytes = 0
        return self

    def remove(self) -> None:
        """Unhook and put every weight back on the device (as before `install`)."""
        for handle in self.handles:
            handle.remove()
        for index in range(len(self.units)):
            self.fill(index)

    # ------------------------------------------------------------ moving one layer
    def fill(self, index: int) -> None:
        if index in self.live:
            return
        unit = self.units[index]
        for storage, host in zip(unit.storages, unit.hosts, strict=True):
            storage.resize_(host.numel())
            _bytes(storage).copy_(host, non_blocking=True)
        self.live.add(index)
        self.copied_bytes += unit.nbytes
        self.resident_bytes += unit.nbytes
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)

    def free(self, index: int) -> None:
        if index not in self.live:
            return
        for storage in self.units[index].storages:
            storage.resize_(0)
        self.live.discard(index)
        self.resident_bytes -= self.units[index].nbytes

    def free_all_but(self, keep: int | None) -> None:
        for index in list(self.live):
            if index != keep:
                self.free(index)

    # ------------------------------------------------------------ hooks
    @staticmethod
    def in_backward() -> bool:
        """Inside autograd's backward: a layer's forward here is the rerun of activation checkpointing."""
        import torch

        return bool(torch._C._current_graph_task_id() != -1)

    def _before_forward(self, index: int) -> Any:
        def hook(_module: Any, _args: Any) -> None:
            if self.in_backward():
                self.free_all_but(index)
            self.fill(index)

        return hook

    def _after_forward(self, index: int) -> Any:
        def hook(_module: Any, _args: Any, output: Any) -> None:
            if self.in_backward():  # the rerun's saved tensors are used right away: keep the weights for them
                return
            self.free(index)
            tensor = output[0] if isinstance(output, (tuple, list)) else output
            if getattr(tensor, "requires_grad", False):
                tensor.register_hook(self._before_backward(index))

        return hook

    def _before_backward(self, index: int) -> Any:
        def hook(_grad: Any) -> None:
            import torch

            if not self._queued:  # the backward's end frees whatever layer is left on the device
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
                self._queued = True
            self.free_all_but(index)
            self.fill(index)

        return hook

    def _backward_done(self) -> None:
        self._queued = False
        self.free_all_but(None)


def _resizable(params: list[Any]) -> Any:
    """The storage `params` share, made resizable where it is not (a tensor over a buffer the checkpoint reader
    filled): a copy of its bytes in a storage of torch's own, each parameter re-pointed at the same place in it."""
    import torch

    storage = params[0].untyped_storage()
    if storage.resizable():
        return storage
    fresh = torch.UntypedStorage(storage.nbytes(), device=storage.device)
    _bytes(fresh).copy_(_bytes(storage))
    for param in params:
        view = torch.empty(0, dtype=param.dtype, device=param.device)
        param.data = view.set_(fresh, param.storage_offset(), param.size(), param.stride())
    return fresh


def _bytes(storage: Any) -> Any:
    """A uint8 tensor over the whole of `storage` (its size as it is now)."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def weight_offload_of(spec: CellSpec, model: Any, device: Any) -> WeightOffload | None:
    """The cell's weight offloading where `train.weight_offloading` is on and the cell trains on a GPU (on CPU the
    weights already live in host memory); None otherwise."""
    if not spec.train.weight_offloading or getattr(device, "type", str(device)) == "cpu":
        return None
    return WeightOffload(model, device).install()
