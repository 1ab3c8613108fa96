"""One optimizer step of a cell's trainer: forward and backward under the planned precision, the optimizer and
its schedule, and the always-on instruments of each step (memory peak, the fused finiteness check). Mixed
into CellTrainer.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any


class OptimizerSteps:
    def forward_backward(self, batch: dict[str, Any], scaler: Any | None = None, scale: float | None = None) -> Any:
        """Loss and grads; under fp16 the loss is scaled by the GradScaler (or by a fixed scale on replay)."""
        from tunegrid.cell.precision import autocast_context

        with autocast_context(self.plan):
            loss = (self.ddp or self.model)(**batch).loss
        if scaler is not None:
            scaler.scale(loss).backward()
        else:
            (loss * scale if scale is not None else loss).backward()
        return loss

    def build_optimizer(self) -> None:
        import torch
        from transformers import get_cosine_with_min_lr_schedule_with_warmup

        from tunegrid.cell.instrument import NonfiniteInjector
        from tunegrid.cell.precision import make_grad_scaler

        train = self.spec["train"]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=train["lr"], weight_decay=train["weight_decay"])
        # linear warm-up from 0, cosine decay to a tenth of the peak (transformers' own schedule)
        self.scheduler = get_cosine_with_min_lr_schedule_with_warmup(
            self.optimizer, num_warmup_steps=train["warmup_steps"], num_training_steps=train["steps"], min_lr_rate=0.1
        )
        self.scaler = make_grad_scaler(self.plan)
        injection = (self.spec.get("debug") or {}).get("inject_nonfinite")
        self.injector = NonfiniteInjector(self.model, injection) if injection and injection.get("module") else None
        if self.ranks.distributed:
            self.wrap_ddp()

    # ---------------------------------------------------------------- one step
    def train_step(self, step: int, batch: dict[str, Any], census: Any = None, headroom: Any = None) -> dict[str, Any]:
        """One optimizer step with the always-on instruments: memory peak and the fused finiteness check."""
        import torch

        scaler = self.scaler
        if self.ranks.distributed:
            self.heartbeat.beat(f"step {step} forward+backward (DDP all-reduce of gradients)")
        self.inject_rank_faults(step)  # a single rank too: a slow step or a crashed worker, on purpose
        fact: dict[str, Any] = {
            "rng_state": torch.get_rng_state(),
            "scale": scaler.get_scale() if scaler is not None else None,
        }
        self.meter.reset()
        started = time.perf_counter()
        with contextlib.ExitStack() as hooks:
            for instrument in (census, headroom):
                if instrument is not None:
                    hooks.enter_context(instrument.attached(self.model))
            if self.injector is not None:
                hooks.enter_context(self.injector.attached(step))
            loss = self.forward_backward(batch, scaler)
        if step == 0:  # every adapter asked for must receive a gradient, or we train fewer params than requested
            fact["params_without_grad"] = [n for n, p in self.trainable_named if p.grad is None]
        if scaler is not None:
            scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.spec["train"]["max_grad_norm"])
        # The one host sync of the step: loss and grad norm together (the norm is needed for clipping
        # anyway, and its finiteness is the NaN check for every gradient at once).
        loss_value, norm_value = torch.stack([loss.detach().float(), grad_norm.float()]).tolist()
        finite = math.isfinite(loss_value) and math.isfinite(norm_value)
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
        self.scheduler.step()
        fact["elapsed"] = time.perf_counter() - started
        fact["peak"] = self.meter.peak_bytes()
        return fact
