"""Signs of life inside a step: the heartbeat beaten as each decoder block runs forward and backward.

A whole step of a real model can take minutes on a slow path (fp16 matmuls on a CPU without fp16 units), longer
than any fixed silence a supervisor could wait for; a block takes a fraction of that. So a single-process worker
beats at every block (at most once a second: a file write), and a hang, which makes no progress at all, is told
from a slow step by the silence alone. Ranks of a distributed cell beat at the collectives instead (their
heartbeat names the collective a stalled rank waits in, which the timeout diagnosis reads).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from tunegrid.runtime.rundir import Heartbeat
from tunegrid.sites import BLOCK_NAME

PULSE_EVERY_S = 1.0


@contextlib.contextmanager
def block_progress(model: Any, heartbeat: Heartbeat) -> Iterator[None]:
    """Pulse the heartbeat as each decoder block (model.layers.N, ...) starts its forward and its backward."""
    last = [0.0]

    def pulse(detail: str) -> None:
        now = time.monotonic()
        if now - last[0] >= PULSE_EVERY_S:
            last[0] = now
            heartbeat.pulse(detail)

    def on_forward(name: str) -> Any:
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            pulse(f"{name} forward")
            tensor = output[0] if isinstance(output, tuple) else output
            if getattr(tensor, "requires_grad", False):
                tensor.register_hook(lambda _grad: pulse(f"{name} backward"))

        return hook

    handles = [
        module.register_forward_hook(on_forward(name))
        for name, module in model.named_modules()
        if BLOCK_NAME.search(name)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
