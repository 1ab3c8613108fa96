"""Where a non-finite value came from: the failing step's micro-batch replayed from the same state with hooks on, and
gradient checkpointing switched off for that replay (its recomputation would re-run the hooks and save a
different number of tensors). Mixed into CellTrainer.
"""

from __future__ import annotations

import contextlib
from typing import Any


class OriginReplay:
    def replay_origin(
        self, step: int, micro_batches: list[dict[str, Any]], fact: dict[str, Any], headroom: Any = None
    ) -> dict[str, Any]:
        """Re-run the failing step's micro-batches from the same state with hooks: which module went non-finite
        first, and in which micro-batch.

        The micro-batch whose loss went non-finite is replayed first; a gradient-only overflow leaves no such
        mark, so each is replayed in turn until one shows it. The weights are as they were before the step: a
        non-finite step never updates them. With a headroom meter, the replayed activations are measured too,
        so the cell's worst headroom is never only the sampled steps'.
        """
        first = fact.get("nonfinite_micro_batch") or 0
        origin: dict[str, Any] = {"forward": None, "backward": None, "micro_batch": None}
        for index in range(first, len(micro_batches)):
            traced = self.replay_micro_batch(step, index, micro_batches[index], fact, headroom)
            if traced["forward"] or traced["backward"]:
                origin = {**traced, "micro_batch": index}
                break
        if headroom is not None:
            origin["headroom"] = headroom.collect(step)
        return origin

    def replay_micro_batch(
        self, step: int, index: int, batch: dict[str, Any], fact: dict[str, Any], headroom: Any
    ) -> dict[str, Any]:
        import torch

        from tunegrid.cell.instrument import OriginTracer

        self.optimizer.zero_grad(set_to_none=True)
        torch.set_rng_state(fact["rng_states"][index])
        real = fact.get("real_positions", [None] * (index + 1))[index]
        tracer = OriginTracer(self.model, real)
        if headroom is not None:
            headroom.real = real
        with contextlib.ExitStack() as hooks:
            # Under activation checkpointing the hooked forward and its recomputation save different
            # tensor counts (CheckpointError); the replay is one step, so it runs without checkpointing.
            hooks.enter_context(self.checkpointing_off())
            if self.injector is not None:  # registered first, so the tracer sees what it injects
                hooks.enter_context(self.injector.attached(step, index))
            hooks.enter_context(tracer.attached())
            if headroom is not None:
                hooks.enter_context(headroom.attached(self.model))
            # no all-reduce on replay: every rank replays on its own (they all saw the same averaged norm)
            hooks.enter_context(self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext())
            self.forward_backward(batch, scale=fact["scale"], step_tokens=fact["step_tokens"])
        self.optimizer.zero_grad(set_to_none=True)
        return tracer.as_dict()

    @contextlib.contextmanager
    def checkpointing_off(self):  # type: ignore[no-untyped-def]
        """Activation checkpointing off for the duration (the replay), then back as it was."""
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        on = getattr(base, "is_activation_checkpointing", None)  # transformers >= 5 name; the old one warns
        if not (on if on is not None else getattr(base, "is_gradient_checkpointing", False)):
            yield
            return
        from tunegrid.cell.model import set_activation_checkpointing

        set_activation_checkpointing(base, False)
        try:
            yield
        finally:
            set_activation_checkpointing(base, True)
