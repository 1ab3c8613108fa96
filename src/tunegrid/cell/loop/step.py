"""One optimizer step of a cell: forward and backward of each micro-batch under the planned precision, the
optimizer and its schedule, and the always-on instruments of each step (memory peak, the fused finiteness
check). `OptimizerStep` holds what a step needs; `StepResult` is what one step leaves.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from dataclasses import dataclass, field
from typing import Any

from tunegrid.cell.data.packing import IGNORE
from tunegrid.cell.loop.precision import PrecisionSetup
from tunegrid.cell.loop.ranks import RankContext
from tunegrid.cell.memory.activation_offload import ActivationOffload, offload_of
from tunegrid.cell.memory.chunked_loss import ChunkedLoss, chunked_loss_of
from tunegrid.cell.nonfinite.injection import NonfiniteInjector
from tunegrid.cell_spec import CellSpec
from tunegrid.runtime.memory import MemoryMeter


def loss_tokens(batch: dict[str, Any]) -> Any:
    """The tokens a causal LM's loss is taken over: labels shift by one, so a row's first label is never one
    (the count transformers' Trainer takes for num_items_in_batch)."""
    return (batch["labels"][..., 1:] != IGNORE).sum()


def accepts_loss_kwargs(model: Any) -> bool:
    """Whether the model's loss takes num_items_in_batch (Trainer's test: the attribute, or **kwargs in forward)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(base, "accepts_loss_kwargs"):
        return bool(base.accepts_loss_kwargs)
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in inspect.signature(base.forward).parameters.values())


@dataclass
class StepResult:
    """What one optimizer step leaves: the numbers its metrics line records, and what a replay of it starts from."""

    scale: float | None  # the GradScaler's scale the step ran at (None without a scaler)
    step_tokens: Any  # the loss tokens of all its micro-batches (a tensor on the device)
    real_positions: list[Any]  # one real-token mask per micro-batch (None where not given)
    rng_states: list[dict[str, Any]] = field(default_factory=list)  # at the start of each micro-batch
    local_time: float = 0.0  # the rank's own time up to its last forward (s)
    params_without_grad: list[str] | None = None  # step 0: adapters that received no gradient
    nonfinite_micro_batch: int | None = None  # the first micro-batch whose loss was not finite
    forward_nonfinite: bool = False  # that loss was seen before its backward: the step ended there
    lr: float = 0.0
    loss: float = math.nan
    grad_norm: float = math.nan
    skipped: bool = False  # no update applied (the GradScaler's skip, or a non-finite step without one)
    elapsed: float = 0.0  # the step's time (s)
    peak: int = 0  # its memory high-water mark (bytes)

    @property
    def scaler_skipped(self) -> bool:
        """The GradScaler found inf/nan gradients, skipped the update and lowered its scale (usually the loss
        scale's doing, not the model's): the step does not count toward train.steps. Decided from the scaler's
        own verdict alone, never from this rank's loss, so that every rank of a cell (whose scalers read the
        same all-reduced gradients) counts the same steps and leaves the loop at the same one."""
        return self.skipped and self.scale is not None and not self.forward_nonfinite and not self.params_without_grad


@dataclass
class OptimizerStep:
    """The model, the optimizer, its schedule and the GradScaler, and how one step runs with them."""

    model: Any
    trainable_named: list[tuple[str, Any]]
    precision: PrecisionSetup
    meter: MemoryMeter
    ranks: RankContext
    optimizer: Any
    optimizer_name: str
    scheduler: Any
    scaler: Any | None  # fp16's GradScaler, else None
    injector: NonfiniteInjector | None  # debug.inject_nonfinite, on this rank
    loss_by_count: bool  # the model's loss takes num_items_in_batch
    max_grad_norm: float
    forward_done_at: float = 0.0  # when the last forward ended (perf_counter): the end of the step's local time
    ddp_pre_forward_s: float = 0.0  # the step's time inside DDP's pre-forward (a sync of the ranks)
    offload: ActivationOffload | None = None  # train.activation_offloading: saved tensors to host memory
    chunked: ChunkedLoss | None = None  # train.loss: chunked: the loss without the full logits

    @classmethod
    def build(
        cls,
        spec: CellSpec,
        model: Any,
        trainable_named: list[tuple[str, Any]],
        precision: PrecisionSetup,
        meter: MemoryMeter,
        ranks: RankContext,
    ) -> OptimizerStep:
        from transformers import get_scheduler

        from tunegrid.cell.loop.precision import make_grad_scaler
        from tunegrid.cell.memory.optimizers import make_optimizer

        train = spec.train
        name = spec.axes.optimizer
        optimizer = make_optimizer([p for _, p in trainable_named], name, train.lr, train.weight_decay)
        # transformers' own schedules; the default: linear warm-up from 0, cosine decay to min_lr_rate of the peak
        schedule = train.lr_scheduler
        scheduler = get_scheduler(
            schedule,
            optimizer,
            num_warmup_steps=train.warmup_steps,
            num_training_steps=train.steps,
            scheduler_specific_kwargs={"min_lr_rate": train.min_lr_rate} if schedule == "cosine_with_min_lr" else None,
        )
        scaler = make_grad_scaler(precision, float(train.loss_scale_init))
        loss_by_count = accepts_loss_kwargs(model)
        injection = spec.debug.inject_nonfinite  # free-form: the fault's request, as the study wrote it
        injector = (
            NonfiniteInjector(model, injection, train.seq_len)
            if injection and injection.get("module") and injection.get("rank", ranks.rank) == ranks.rank
            else None
        )
        return cls(
            model=model,
            trainable_named=trainable_named,
            precision=precision,
            meter=meter,
            ranks=ranks,
            optimizer=optimizer,
            optimizer_name=name,
            scheduler=scheduler,
            scaler=scaler,
            injector=injector,
            loss_by_count=loss_by_count,
            max_grad_norm=train.max_grad_norm,
            offload=offload_of(spec, ranks.device),
            chunked=chunked_loss_of(spec, model),
        )

    @property
    def trainable(self) -> list[Any]:
        return [p for _, p in self.trainable_named]

    def forward_backward(
        self,
        batch: dict[str, Any],
        scaler: Any | None = None,
        scale: float | None = None,
        step_tokens: Any = None,
        check_forward: bool = False,
    ) -> Any:
        """Loss and grads of one micro-batch; under fp16 the loss is scaled by the GradScaler (or by a fixed scale
        on replay).

        The loss is the micro-batch's summed token loss over `step_tokens`, the loss tokens of the whole optimizer
        step (transformers' num_items_in_batch), so the micro-batches' losses and gradients add up to those of
        one batch holding them all, whatever their share of loss tokens.
        """
        from tunegrid.cell.loop.precision import autocast_context

        by_count = self.loss_by_count
        ddp = self.ranks.ddp
        called = time.perf_counter()
        offloaded = self.offload.active() if self.offload is not None else contextlib.nullcontext()
        with autocast_context(self.precision), offloaded:
            if self.chunked is not None:  # the same loss, its logits a chunk at a time
                loss = self.chunked.loss(ddp or self.model, batch, step_tokens if by_count else None)
            else:
                loss = (ddp or self.model)(**batch, **({"num_items_in_batch": step_tokens} if by_count else {})).loss
        self.forward_done_at = time.perf_counter()  # the last micro-batch's ends the step's local time
        if ddp is not None:  # DDP's pre-forward syncs the ranks once (its bucket rebuild, 2nd iteration)
            self.ddp_pre_forward_s += self.ranks.inner_forward_at - called
        if not by_count:  # a model that only averages: weigh its mean by the micro-batch's share of the tokens
            loss = loss * (loss_tokens(batch) / step_tokens)
        if check_forward and not bool(loss.isfinite()):  # a host sync: see run()
            return loss  # no backward: the step's verdict is already certain
        if scaler is not None:
            scaler.scale(loss).backward()
        else:
            (loss * scale if scale is not None else loss).backward()
        return loss

    # ---------------------------------------------------------------- one step
    def run(
        self,
        step: int,
        micro_batches: list[dict[str, Any]],
        census: Any = None,
        headroom: Any = None,
        real_positions: list[Any] | None = None,
    ) -> StepResult:
        """One optimizer step over its micro-batches, with the always-on instruments: memory peak and the fused
        finiteness check. `real_positions` (one real-token mask per micro-batch, never given to the model)
        lets the headroom meter, and a replay's origin tracer, read real tokens only.

        Every micro-batch's backward adds into the same gradients (each scaled by the GradScaler under fp16;
        DDP all-reduces them on the last one only); then, once per step, the scaler unscales, the norm is
        clipped and checked, and the optimizer steps.
        """
        import torch

        from tunegrid.cell.loop.resume import rng_states

        scaler = self.scaler
        if self.ranks.distributed:
            self.ranks.heartbeat.beat(f"step {step} forward+backward (DDP all-reduce of gradients)")
        else:
            self.ranks.heartbeat.beat(f"step {step}")
        # the rank's local time: from here to its last forward, before the backward joins the gradient
        # all-reduce (a straggler's own slowness, not its peers' wait for it)
        local_started = time.perf_counter()
        self.ddp_pre_forward_s = 0.0
        self.ranks.inject_faults(step)  # a single rank too: a slow step or a crashed worker, on purpose
        step_tokens = sum(loss_tokens(micro) for micro in micro_batches)
        result = StepResult(
            scale=scaler.get_scale() if scaler is not None else None,
            step_tokens=step_tokens,
            real_positions=real_positions or [None] * len(micro_batches),
        )
        self.meter.reset()
        if self.offload is not None:
            self.offload.moved_bytes = 0
        # the step's wall time runs from before an injected delay: a slow rank's own step is as long as its
        # peers' (they wait for it in the all-reduce), as a user's run would see it
        started = local_started
        losses = []
        last = len(micro_batches) - 1
        # A non-finite loss concludes the step before its backward (which on a slow fp16 path takes minutes and
        # cannot make the loss finite again). Checking costs a host sync per micro-batch: free on a CPU, whose
        # kernels run synchronously anyway, and on CUDA paid at step 0 only, where an overflow of the model's
        # own activations shows. Ranks never stop alone: a peer would wait in the gradient all-reduce.
        check_forward = not self.ranks.distributed and (self.ranks.device.type == "cpu" or step == 0)
        with contextlib.ExitStack() as hooks:
            for instrument in (census, headroom):
                if instrument is not None:
                    hooks.enter_context(instrument.attached(self.model))
            for index, micro in enumerate(micro_batches):
                result.rng_states.append(rng_states())  # what a replay of this micro-batch starts from
                if headroom is not None:
                    headroom.real = result.real_positions[index]
                with contextlib.ExitStack() as around:
                    if self.injector is not None:
                        around.enter_context(self.injector.attached(step, index))
                    if index < last:  # one all-reduce per step, in the last backward
                        around.enter_context(self.ranks.no_sync())
                    loss = self.forward_backward(micro, scaler, step_tokens=step_tokens, check_forward=check_forward)
                    losses.append(loss.detach().float())
                if check_forward and not bool(losses[-1].isfinite()):
                    return self.nonfinite_forward(result, losses, started)
        # the rank's own time up to its last forward (a step without an update records it too)
        result.local_time = self.forward_done_at - local_started - self.ddp_pre_forward_s
        if step == 0:  # every adapter asked for must receive a gradient, or we train fewer params than requested
            result.params_without_grad = [n for n, p in self.trainable_named if p.grad is None]
            if result.params_without_grad:
                return self.without_update(result, losses, started)
        if scaler is not None:
            scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.max_grad_norm)
        # The one host sync of the step: the loss, the grad norm and each micro-batch's loss together (the norm
        # is needed for clipping anyway, and its finiteness is the NaN check for every gradient at once).
        stacked = torch.stack(losses)
        together = torch.cat([stacked.sum()[None], grad_norm.float()[None], stacked])
        loss_value, norm_value, *micro_losses = together.tolist()
        finite = math.isfinite(loss_value) and math.isfinite(norm_value)
        result.nonfinite_micro_batch = next((i for i, v in enumerate(micro_losses) if not math.isfinite(v)), None)
        if scaler is not None:
            scaler.step(self.optimizer)  # skips the update itself when grads are inf/nan
            scaler.update()
            skipped = scaler.get_scale() < result.scale
        elif finite:
            self.optimizer.step()
            skipped = False
        else:
            skipped = True  # never apply a non-finite update to the weights
        self.optimizer.zero_grad(set_to_none=True)
        result.lr, result.loss, result.grad_norm = self.scheduler.get_last_lr()[0], loss_value, norm_value
        result.skipped = skipped
        if not skipped:  # as accelerate does: a step that changed no weight does not advance the schedule
            self.scheduler.step()
        result.elapsed = time.perf_counter() - started
        result.peak = self.meter.peak_bytes()
        return result

    def nonfinite_forward(self, result: StepResult, losses: list[Any], started: float) -> StepResult:
        """A step whose micro-batch loss went non-finite in its forward: no backward, no scaler, no update. The
        GradScaler's scale stays (a forward overflow is not the loss scale's doing); the gradients of earlier
        micro-batches are dropped with the step."""
        self.forward_done_at = time.perf_counter()
        result.local_time = self.forward_done_at - started
        self.optimizer.zero_grad(set_to_none=True)
        result.nonfinite_micro_batch, result.forward_nonfinite = len(losses) - 1, True
        result.lr, result.loss, result.grad_norm = self.scheduler.get_last_lr()[0], math.nan, math.nan
        result.skipped = True
        result.elapsed = time.perf_counter() - started
        result.peak = self.meter.peak_bytes()
        return result

    def without_update(self, result: StepResult, losses: list[Any], started: float) -> StepResult:
        """Step 0 of a cell that ends `unsupported` (an adapter got no gradient): no scaler, no clipping, no
        update. With no gradient at all, GradScaler.step asserts "No inf checks were recorded" and
        clip_grad_norm_ returns a CPU zero that a CUDA loss cannot be concatenated with; the norm is taken here
        over the gradients that did arrive, on the loss's device."""
        import torch

        grads = [p.grad.detach().float().norm() for p in self.trainable if p.grad is not None]
        norm = torch.stack(grads).norm() if grads else torch.zeros((), device=losses[0].device)
        loss_value, norm_value = torch.stack([torch.stack(losses).sum(), norm.to(losses[0].device)]).tolist()
        self.optimizer.zero_grad(set_to_none=True)
        result.lr, result.loss, result.grad_norm = self.scheduler.get_last_lr()[0], loss_value, norm_value
        result.skipped, result.nonfinite_micro_batch = True, None
        result.elapsed = time.perf_counter() - started
        result.peak = self.meter.peak_bytes()
        return result
