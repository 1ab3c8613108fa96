"""Where a non-finite value came from: the failing step replayed from the same state with hooks on, and
gradient checkpointing switched off for that replay (its recomputation would re-run the hooks and save a
different number of tensors). Mixed into CellTrainer.
"""

from __future__ import annotations

import contextlib
from typing import Any


class OriginReplay:
    def replay_origin(
        self, step: int, batch: dict[str, Any], rng_state: Any, scale: float | None, headroom: Any = None
    ) -> dict[str, Any]:
        """Re-run the failing step from the same state with hooks: which module went non-finite first.

        The weights are as they were before the step: a non-finite step never updates them. With a
        headroom meter, the failing step's activations are measured too, so the cell's worst headroom
        is never only the sampled steps'.
        """
        import torch

        from tunegrid.cell.instrument import OriginTracer

        self.optimizer.zero_grad(set_to_none=True)
        torch.set_rng_state(rng_state)
        tracer = OriginTracer(self.model)
        with contextlib.ExitStack() as hooks:
            # Under activation checkpointing the hooked forward and its recomputation save different
            # tensor counts (CheckpointError); the replay is one step, so it runs without checkpointing.
            hooks.enter_context(self.checkpointing_off())
            if self.injector is not None:  # registered first, so the tracer sees what it injects
                hooks.enter_context(self.injector.attached(step))
            hooks.enter_context(tracer.attached())
            if headroom is not None:
                hooks.enter_context(headroom.attached(self.model))
            # no all-reduce on replay: every rank replays on its own (they all saw the same averaged norm)
            hooks.enter_context(self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext())
            self.forward_backward(batch, scale=scale)
        self.optimizer.zero_grad(set_to_none=True)
        origin = tracer.as_dict()
        if headroom is not None:
            origin["headroom"] = headroom.collect(step)
        return origin

    @contextlib.contextmanager
    def checkpointing_off(self):  # type: ignore[no-untyped-def]
        """Activation checkpointing off for the duration (the replay), then back as it was."""
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        on = getattr(base, "is_activation_checkpointing", None)  # transformers >= 5 name; the old one warns
        if not (on if on is not None else getattr(base, "is_gradient_checkpointing", False)):
            yield
            return
        base.gradient_checkpointing_disable()
        try:
            yield
        finally:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
