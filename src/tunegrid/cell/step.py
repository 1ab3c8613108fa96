"""One optimizer step of a cell's trainer: forward and backward of each micro-batch under the planned precision,
the optimizer and its schedule, and the always-on instruments of each step (memory peak, the fused finiteness
check). Mixed into CellTrainer.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from typing import Any

from tunegrid.cell.packing import IGNORE


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


class OptimizerSteps:
    def forward_backward(
        self, batch: dict[str, Any], scaler: Any | None = None, scale: float | None = None, step_tokens: Any = None
    ) -> Any:
        """Loss and grads of one micro-batch; under fp16 the loss is scaled by the GradScaler (or by a fixed scale
        on replay).

        The loss is the micro-batch's summed token loss over `step_tokens`, the loss tokens of the whole optimizer
        step (transformers' num_items_in_batch), so the micro-batches' losses and gradients add up to those of
        one batch holding them all, whatever their share of loss tokens.
        """
        from tunegrid.cell.precision import autocast_context

        by_count = self.loss_by_count
        called = time.perf_counter()
        with autocast_context(self.plan):
            loss = (self.ddp or self.model)(**batch, **({"num_items_in_batch": step_tokens} if by_count else {})).loss
        self.forward_done_at = time.perf_counter()  # the last micro-batch's ends the step's local time
        if self.ddp is not None:  # DDP's pre-forward syncs the ranks once (its bucket rebuild, 2nd iteration)
            self.ddp_pre_forward_s += self.inner_forward_at - called
        if not by_count:  # a model that only averages: weigh its mean by the micro-batch's share of the tokens
            loss = loss * (loss_tokens(batch) / step_tokens)
        if scaler is not None:
            scaler.scale(loss).backward()
        else:
            (loss * scale if scale is not None else loss).backward()
        return loss

    def build_optimizer(self) -> None:
        from transformers import get_scheduler

        from tunegrid.cell.injection import NonfiniteInjector
        from tunegrid.cell.optimizers import make_optimizer
        from tunegrid.cell.precision import make_grad_scaler

        train = self.spec["train"]
        self.optimizer_name = self.spec["axes"].get("optimizer", "adamw")
        self.optimizer = make_optimizer(self.trainable, self.optimizer_name, train["lr"], train["weight_decay"])
        # transformers' own schedules; the default: linear warm-up from 0, cosine decay to min_lr_rate of the peak
        name = train["lr_scheduler"]
        self.scheduler = get_scheduler(
            name,
            self.optimizer,
            num_warmup_steps=train["warmup_steps"],
            num_training_steps=train["steps"],
            scheduler_specific_kwargs={"min_lr_rate": train["min_lr_rate"]} if name == "cosine_with_min_lr" else None,
        )
        self.scaler = make_grad_scaler(self.plan)
        self.loss_by_count = accepts_loss_kwargs(self.model)
        injection = (self.spec.get("debug") or {}).get("inject_nonfinite")
        self.injector = (
            NonfiniteInjector(self.model, injection, train["seq_len"])
            if injection and injection.get("module") and injection.get("rank", self.ranks.rank) == self.ranks.rank
            else None
        )
        if self.ranks.distributed:
            self.wrap_ddp()

    # ---------------------------------------------------------------- one step
    def train_step(
        self,
        step: int,
        micro_batches: list[dict[str, Any]],
        census: Any = None,
        headroom: Any = None,
        real_positions: list[Any] | None = None,
    ) -> dict[str, Any]:
        """One optimizer step over its micro-batches, with the always-on instruments: memory peak and the fused
        finiteness check. `real_positions` (one real-token mask per micro-batch, never given to the model)
        lets the headroom meter, and a replay's origin tracer, read real tokens only.

        Every micro-batch's backward adds into the same gradients (each scaled by the GradScaler under fp16;
        DDP all-reduces them on the last one only); then, once per step, the scaler unscales, the norm is
        clipped and checked, and the optimizer steps.
        """
        import torch

        from tunegrid.cell.resume import rng_states

        scaler = self.scaler
        if self.ranks.distributed:
            self.heartbeat.beat(f"step {step} forward+backward (DDP all-reduce of gradients)")
        # the rank's local time: from here to its last forward, before the backward joins the gradient
        # all-reduce (a straggler's own slowness, not its peers' wait for it)
        local_started = time.perf_counter()
        self.ddp_pre_forward_s = 0.0
        self.inject_rank_faults(step)  # a single rank too: a slow step or a crashed worker, on purpose
        step_tokens = sum(loss_tokens(micro) for micro in micro_batches)
        fact: dict[str, Any] = {
            "rng_states": [],  # at the start of each micro-batch: what a replay of it starts from
            "scale": scaler.get_scale() if scaler is not None else None,
            "step_tokens": step_tokens,
            "real_positions": real_positions or [None] * len(micro_batches),
        }
        self.meter.reset()
        started = time.perf_counter()
        losses = []
        last = len(micro_batches) - 1
        with contextlib.ExitStack() as hooks:
            for instrument in (census, headroom):
                if instrument is not None:
                    hooks.enter_context(instrument.attached(self.model))
            for index, micro in enumerate(micro_batches):
                fact["rng_states"].append(rng_states())
                if headroom is not None:
                    headroom.real = fact["real_positions"][index]
                with contextlib.ExitStack() as around:
                    if self.injector is not None:
                        around.enter_context(self.injector.attached(step, index))
                    if self.ddp is not None and index < last:  # one all-reduce per step, in the last backward
                        around.enter_context(self.ddp.no_sync())
                    losses.append(self.forward_backward(micro, scaler, step_tokens=step_tokens).detach().float())
        # the rank's own time up to its last forward (a step without an update records it too)
        fact["local_time"] = self.forward_done_at - local_started - self.ddp_pre_forward_s
        if step == 0:  # every adapter asked for must receive a gradient, or we train fewer params than requested
            fact["params_without_grad"] = [n for n, p in self.trainable_named if p.grad is None]
            if fact["params_without_grad"]:
                return self.step_without_update(fact, losses, started)
        if scaler is not None:
            scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.spec["train"]["max_grad_norm"])
        # The one host sync of the step: the loss, the grad norm and each micro-batch's loss together (the norm
        # is needed for clipping anyway, and its finiteness is the NaN check for every gradient at once).
        stacked = torch.stack(losses)
        together = torch.cat([stacked.sum()[None], grad_norm.float()[None], stacked])
        loss_value, norm_value, *micro_losses = together.tolist()
        finite = math.isfinite(loss_value) and math.isfinite(norm_value)
        fact["nonfinite_micro_batch"] = next((i for i, v in enumerate(micro_losses) if not math.isfinite(v)), None)
        if scaler is not None:
            scaler.step(self.optimizer)  # skips the update itself when grads are inf/nan
            scaler.update()
            skipped = scaler.get_scale() < fact["scale"]
        elif finite:
            self.optimizer.step()
            skipped = False
        else:
            skipped = True  # never apply a non-finite update to the weights
        self.optimizer.zero_grad(set_to_none=True)
        fact.update(lr=self.scheduler.get_last_lr()[0], loss=loss_value, grad_norm=norm_value, skipped=skipped)
        if not skipped:  # as accelerate does: a step that changed no weight does not advance the schedule
            self.scheduler.step()
        fact["elapsed"] = time.perf_counter() - started
        fact["peak"] = self.meter.peak_bytes()
        return fact

    def step_without_update(self, fact: dict[str, Any], losses: list[Any], started: float) -> dict[str, Any]:
        """Step 0 of a cell that ends `unsupported` (an adapter got no gradient): no scaler, no clipping, no
        update. With no gradient at all, GradScaler.step asserts "No inf checks were recorded" and
        clip_grad_norm_ returns a CPU zero that a CUDA loss cannot be concatenated with; the norm is taken here
        over the gradients that did arrive, on the loss's device."""
        import torch

        grads = [p.grad.detach().float().norm() for p in self.trainable if p.grad is not None]
        norm = torch.stack(grads).norm() if grads else torch.zeros((), device=losses[0].device)
        loss_value, norm_value = torch.stack([torch.stack(losses).sum(), norm.to(losses[0].device)]).tolist()
        self.optimizer.zero_grad(set_to_none=True)
        fact.update(
            lr=self.scheduler.get_last_lr()[0],
            loss=loss_value,
            grad_norm=norm_value,
            skipped=True,
            nonfinite_micro_batch=None,
            elapsed=time.perf_counter() - started,
            peak=self.meter.peak_bytes(),
        )
        return fact
