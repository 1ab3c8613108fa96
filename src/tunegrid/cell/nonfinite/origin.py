"""Where a non-finite value came from: the failing step's micro-batch replayed from the same state with hooks on, and
activation checkpointing switched off for that replay (its recomputation would re-run the hooks and save a
different number of tensors).

Without activation checkpointing the replay keeps every layer's activations, more than the training step did: where that
runs out of memory the replay degrades and never changes the cell's outcome. It falls back to a forward-only
replay without gradients (one layer's activations at a time: the forward origin is still found, the backward
one is marked unlocated), and where even that runs out of memory the origin is unlocated, saying why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tunegrid.cell.loop.step import OptimizerStep, StepResult


@dataclass
class FailingStepReplay:
    """The replay of a failing step: the step's own forward and backward (its model, optimizer, injected faults,
    DDP and precision), run again from the state the step started from, with the tracing hooks on."""

    step: OptimizerStep

    def origin(
        self, step: int, micro_batches: list[dict[str, Any]], result: StepResult, headroom: Any = None
    ) -> dict[str, Any]:
        """Re-run the failing step's micro-batches from the same state with hooks: which module went non-finite
        first, and in which micro-batch.

        The micro-batch whose loss went non-finite is replayed first; a gradient-only overflow leaves no such
        mark, so each is replayed in turn until one shows it. The weights are as they were before the step: a
        non-finite step never updates them. With a headroom meter, the replayed activations are measured too,
        so the cell's worst headroom is never only the sampled steps'.
        """
        first = result.nonfinite_micro_batch or 0
        origin: dict[str, Any] = {"forward": None, "backward": None, "micro_batch": None}
        for index in range(first, len(micro_batches)):
            traced = self.replay_micro_batch(step, index, micro_batches[index], result, headroom)
            if traced["forward"] or traced["backward"]:
                origin = {**traced, "micro_batch": index}
                break
            if traced["replay"] != "full":  # a degraded replay found nothing: say why, not "unknown"
                origin.update(replay=traced["replay"], unlocated=traced["unlocated"])
            if traced["replay"] == "out of memory":  # the next micro-batch's replay needs the same memory
                break
        if headroom is not None:
            origin["headroom"] = headroom.collect(step)
        return origin

    def replay_micro_batch(
        self, step: int, index: int, batch: dict[str, Any], result: StepResult, headroom: Any
    ) -> dict[str, Any]:
        """Forward and backward traced; out of memory, the forward alone; out of memory again, unlocated. A step
        whose loss went non-finite in its forward is replayed forward only: the forward origin is the answer,
        and a backward through non-finite activations would only spread them."""
        if result.forward_nonfinite and index == result.nonfinite_micro_batch:
            why = "backward origin not traced: the step's forward loss was not finite (no backward ran)"
            try:
                traced = self.traced_replay(step, index, batch, result, headroom, backward=False)
            except Exception as exc:  # noqa: BLE001 - only out-of-memory degrades; anything else is re-raised
                forward = out_of_memory_text(exc, "the forward-only replay")
            else:
                return {**traced, "replay": "forward only", "unlocated": why}
            self.release_replay_memory()
            return {"forward": None, "backward": None, "replay": "out of memory", "unlocated": f"{why}; {forward}"}
        try:
            return {**self.traced_replay(step, index, batch, result, headroom, backward=True), "replay": "full"}
        except Exception as exc:  # noqa: BLE001 - only out-of-memory degrades; anything else is re-raised
            full = out_of_memory_text(exc, "the forward+backward replay without activation checkpointing")
        self.release_replay_memory()  # outside the handler: the exception's frames held the replay's tensors
        try:
            traced = self.traced_replay(step, index, batch, result, None, backward=False)
        except Exception as exc:  # noqa: BLE001
            forward = out_of_memory_text(exc, "the forward-only replay")
        else:
            return {**traced, "replay": "forward only", "unlocated": f"backward origin not traced: {full}"}
        self.release_replay_memory()
        return {"forward": None, "backward": None, "replay": "out of memory", "unlocated": f"{full}; {forward}"}

    def release_replay_memory(self) -> None:
        import gc

        import torch

        self.step.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if self.step.ranks.device.type == "cuda":
            torch.cuda.empty_cache()

    def traced_replay(
        self, step: int, index: int, batch: dict[str, Any], result: StepResult, headroom: Any, backward: bool
    ) -> dict[str, Any]:
        import torch

        from tunegrid.cell.loop.instrument import OriginTracer
        from tunegrid.cell.loop.resume import set_rng_states

        trained = self.step
        trained.optimizer.zero_grad(set_to_none=True)
        set_rng_states(result.rng_states[index])  # CPU and CUDA generators: the same dropout masks
        real = result.real_positions[index]
        tracer = OriginTracer(trained.model, real)
        if headroom is not None:
            headroom.real = real
        with contextlib.ExitStack() as hooks:
            # Under activation checkpointing the hooked forward and its recomputation save different
            # tensor counts (CheckpointError); the replay is one step, so it runs without recomputation.
            hooks.enter_context(activation_checkpointing_off(trained.model))
            if trained.injector is not None:  # registered first, so the tracer sees what it injects
                hooks.enter_context(trained.injector.attached(step, index))
            hooks.enter_context(tracer.attached())
            if headroom is not None:
                hooks.enter_context(headroom.attached(trained.model))
            # no all-reduce on replay: every rank replays on its own (they all saw the same averaged norm)
            hooks.enter_context(trained.ranks.no_sync())
            if backward:
                trained.forward_backward(batch, scale=result.scale, step_tokens=result.step_tokens)
            else:  # no graph: each layer's activations are freed as the next one runs
                from tunegrid.cell.loop.precision import autocast_context

                with torch.no_grad(), autocast_context(trained.precision):
                    if trained.chunked is not None:  # train.loss: chunked: no full logits here either
                        trained.chunked.loss(trained.model, batch)
                    else:
                        trained.model(**batch)
        trained.optimizer.zero_grad(set_to_none=True)
        return tracer.as_dict()


@contextlib.contextmanager
def activation_checkpointing_off(model: Any) -> Iterator[None]:
    """Activation checkpointing off for the duration (the replay), then back as it was."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    on = getattr(base, "is_activation_checkpointing", None)  # transformers >= 5 name; the old one warns
    if not (on if on is not None else getattr(base, "is_gradient_checkpointing", False)):
        yield
        return
    from tunegrid.cell.load.model import set_activation_checkpointing

    set_activation_checkpointing(base, False)
    try:
        yield
    finally:
        set_activation_checkpointing(base, True)


def out_of_memory_text(exc: BaseException, what: str) -> str:
    """Why a replay gave up; anything but out-of-memory is not the replay's to absorb and is re-raised."""
    from tunegrid.cell.loop.faults import classify_exception
    from tunegrid.vocabulary import Outcome

    if classify_exception(exc) != Outcome.OOM:
        raise exc
    first_line = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    return f"{what} ran out of memory ({first_line})"
