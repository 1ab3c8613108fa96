"""Fault injection for testing the pipeline: a non-finite value put into a module's output or gradient on
purpose (`debug.inject_nonfinite`), so the instruments' diagnosis can be checked against a known origin."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


class NonfiniteInjector:
    """Fault injection for testing the pipeline: a non-finite value at one module, one step (and micro-batch).

    Off unless the study's `debug.inject_nonfinite` asks for it. The module is matched by name suffix
    (`model.layers.0.mlp.down_proj` matches the peft-wrapped `base_model.model.model.layers.0.mlp.down_proj`).
    `also` lists further injections (same fields), for sequences such as a recovered scaler skip
    followed by a later overflow.
    """

    def __init__(self, model: Any, request: dict[str, Any], seq_len: int = 0) -> None:
        self.injections = [
            _Injection(model, r, seq_len) for r in (request, *(request.get("also") or ())) if r.get("module")
        ]
        first = self.injections[0]
        self.step, self.phase, self.module_name = first.step, first.phase, first.module_name

    @contextlib.contextmanager
    def attached(self, step: int, micro_batch: int = 0) -> Iterator[None]:
        handles = [
            i.module.register_forward_hook(i.on_forward)
            for i in self.injections
            if (i.step, i.micro_batch) == (step, micro_batch)
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


class _Injection:
    def __init__(self, model: Any, request: dict[str, Any], seq_len: int) -> None:
        position = request.get("position") or {}
        # (row, token) of the micro-batch as drawn; rows of seq_len tokens, one after another when flattened
        self.flat_position = position["row"] * seq_len + position["token"] if position else None
        self.step = int(request.get("step", 0))
        self.micro_batch = int(request.get("micro_batch", 0))
        self.phase = request.get("phase", "forward")
        self.value = float(request.get("value", "inf"))
        wanted = request["module"]
        matches = [(n, m) for n, m in model.named_modules() if n == wanted or n.endswith("." + wanted)]
        if not matches:
            raise ValueError(f"debug.inject_nonfinite.module {wanted!r} matches no module of the model")
        self.module_name, self.module = min(matches, key=lambda item: len(item[0]))  # the outermost match

    def on_forward(self, _module: Any, _inputs: Any, output: Any) -> Any:
        tensor = output[0] if isinstance(output, tuple) else output
        if self.phase == "forward":
            poisoned = self._poisoned(tensor)
            return (poisoned, *output[1:]) if isinstance(output, tuple) else poisoned
        if tensor.requires_grad:
            tensor.register_hook(self._poisoned)
        return None

    def _poisoned(self, tensor: Any) -> Any:
        """A copy with the value at the first element, or at the first feature of the asked token position
        (outputs are (batch, seq, ...), one flattened row, or (batch*seq, ...))."""
        poisoned = tensor.clone()
        if self.flat_position is None:
            poisoned.view(-1)[0] = self.value
        else:
            by_position = poisoned.flatten(0, 1) if poisoned.dim() >= 3 else poisoned
            by_position[self.flat_position].view(-1)[0] = self.value
        return poisoned
