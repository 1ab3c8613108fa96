"""What the loop writes and decides: a step's metrics line, a non-finite event with its origin, and the
summary that turns the loop's state into the cell's facts and outcome (ok only if every step ran and none
ended non-finite). Mixed into CellTrainer.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

from tunegrid.cell.loop_state import LoopState
from tunegrid.outcome import StepMetrics
from tunegrid.vocabulary import Outcome


class StepRecords:
    def record(
        self, step: int, fact: dict[str, Any], measured_headroom: bool, state: LoopState, logs: dict[str, Any]
    ) -> None:
        """One line of metrics.jsonl, and the running tallies (step 0 is the first-step peak, not steady)."""
        tokens = self.stream.real_tokens(step)  # padding excluded, packed or not
        state.skipped_total += int(fact["skipped"])
        state.consecutive_skips = state.consecutive_skips + 1 if fact["skipped"] else 0
        if step == 0:
            self.memory["first_step_peak_bytes"] = fact["peak"]
            state.unsupported = fact["params_without_grad"] or []
        else:
            state.step_times.append(fact["elapsed"])
            state.tokens_per_s.append(tokens / fact["elapsed"])
            state.steady_peaks.append(fact["peak"])
        headroom = None
        if measured_headroom:
            worst = state.headroom.collect(step)
            logs["headroom"].write(worst)
            headroom = worst["max_ratio"]
        metrics = StepMetrics(
            step=step,
            time=time.time(),
            loss=fact["loss"],
            grad_norm=fact["grad_norm"],
            lr=fact["lr"],
            tokens_per_s=tokens / fact["elapsed"],
            step_time_s=fact["elapsed"],
            local_time_s=fact["local_time"],
            mem_peak_bytes=fact["peak"],
            skipped_steps=state.skipped_total,
            loss_scale=fact["scale"] if self.scaler is not None else None,
            fp16_headroom_max_ratio=headroom,
        )
        logs["metrics"].write(metrics.as_record())

    def on_nonfinite(
        self,
        step: int,
        micro_batches: list[dict[str, Any]],
        fact: dict[str, Any],
        state: LoopState,
        logs: dict[str, Any],
    ) -> bool:
        """A step whose loss or gradient is not finite becomes an event with its origin; True ends the loop."""
        train = self.spec["train"]
        loss_finite, grad_finite = math.isfinite(fact["loss"]), math.isfinite(fact["grad_norm"])
        if loss_finite:
            state.losses.append(fact["loss"])
        if loss_finite and grad_finite:
            return False
        kind = "loss_nonfinite" if not loss_finite else ("scaler_skip" if self.scaler else "grad_nonfinite_finite_loss")
        event = {
            "step": step,
            "kind": kind,
            "loss": fact["loss"],
            "grad_norm": fact["grad_norm"],
            "loss_scale": fact["scale"],
        }
        policy = train["on_nonfinite"]
        stop = (
            policy == "stop"
            or (policy == "stop_after_skips" and kind != "scaler_skip")
            or (policy == "stop_after_skips" and state.consecutive_skips >= train["max_consecutive_skips"])
        )
        # Every event that ends the cell or is the first of its kind gets its origin (a replay of that
        # step); repeats of a kind already traced under `continue` are recorded without one.
        if stop or kind not in {e["kind"] for e in state.nonfinite_events}:
            event["origin"] = self.replay_origin(step, micro_batches, fact, state.headroom)
            event["micro_batch"] = event["origin"]["micro_batch"]
            event["headroom"] = event["origin"].pop("headroom")
            logs["headroom"].write({**event["headroom"], "failing_step": True})
            state.headroom_steps.append(step)
        state.nonfinite_events.append(event)
        logs["events"].write(event)
        if stop:
            state.stop_event = event
        return stop

    def summarise(self, state: LoopState) -> None:
        """The cell's facts from the loop: peaks, dtypes seen, headroom, throughput, and the outcome."""
        steps_run = state.last_step + 1
        self.memory["steady_peak_bytes"] = max(state.steady_peaks) if state.steady_peaks else None
        self.memory["peak_bytes"] = max(
            v
            for v in (
                self.memory.get("load_peak_bytes"),
                self.memory.get("first_step_peak_bytes"),
                self.memory["steady_peak_bytes"],
            )
            if v
        )
        self.facts["precision_in_effect"].update(state.census.as_dict())
        self.facts["fp16_headroom"] = {
            **state.headroom.summary(),
            "sampled_every": self.spec["train"][
                "headroom_every"
            ],  # the worst is over these samples plus the failing steps
            "failing_steps_measured": state.headroom_steps,
        }
        self.facts["throughput"] = {
            "tokens_per_s_median": statistics.median(state.tokens_per_s) if state.tokens_per_s else None,
            "step_time_s_median": statistics.median(state.step_times) if state.step_times else None,
        }
        self.facts["training"] = {
            "steps_run": steps_run,
            "initial_loss": state.losses[0] if state.losses else None,
            "final_loss": state.losses[-1] if state.losses else None,
            "skipped_steps": state.skipped_total,
        }
        self._conclude(
            state.nonfinite_events, state.stop_event, state.consecutive_skips, steps_run, state.skipped_total
        )
        if state.stopped_by_peer is not None and state.stop_event is None and self.facts["outcome"] == Outcome.ERROR:
            # no event of this rank's own ended it: a peer's did (its rank folder holds that event's origin)
            self.facts.update(
                outcome=Outcome.NAN,
                reason=f"stopped at step {state.stopped_by_peer} with the other ranks: another rank's step ended "
                "the cell",
                diagnosis={**self.facts.get("diagnosis", {}), "stopped_by_peer": {"step": state.stopped_by_peer}},
            )
        if self.ranks.distributed:
            self.facts["lora_sha256"] = self.lora_digest()
        if state.unsupported:
            self.facts.update(
                outcome=Outcome.UNSUPPORTED,
                reason=f"{len(state.unsupported)} adapter tensors get no gradient with this peft/bitsandbytes "
                "combination "
                f"(e.g. {state.unsupported[0]}); refusing to train fewer parameters than requested",
                diagnosis={"params_without_grad": state.unsupported},
            )

    def _conclude(
        self,
        events: list[dict[str, Any]],
        stop_event: dict[str, Any] | None,
        consecutive_skips: int,
        steps_run: int,
        skipped: int = 0,
    ) -> None:
        """ok only if every step ran and none ended non-finite; else nan with the event that decided it.

        The deciding event is the one that stopped the loop, else the first non-finite loss/gradient
        (under `continue`), else scaler skips the scaler did not recover from. Scaler skips it recovered
        from are listed, not failures.
        """
        train = self.spec["train"]
        hard = [e for e in events if e["kind"] != "scaler_skip"]
        unrecovered_skips = bool(events) and (
            train["on_nonfinite"] == "stop" or consecutive_skips >= train["max_consecutive_skips"]
        )
        deciding = stop_event or (hard[0] if hard else None) or (events[0] if unrecovered_skips else None)
        recovered = [e for e in events if e["kind"] == "scaler_skip" and e is not deciding]
        diagnosis: dict[str, Any] = {"recovered_scaler_skips": recovered[0]} if recovered else {}
        if deciding is not None:
            origin = deciding.get("origin") or {}
            traced = origin.get("forward") or origin.get("backward")
            where = origin_text(traced) if traced or not origin.get("unlocated") else f"? ({origin['unlocated']})"
            stopped = f"; stopped after {steps_run} of {train['steps']} steps" if steps_run < train["steps"] else ""
            accum = self.spec["axes"].get("grad_accum", 1)
            micro = (
                f" (micro-batch {deciding['micro_batch']} of {accum})"
                if accum > 1 and deciding.get("micro_batch") is not None
                else ""
            )
            self.facts.update(
                outcome=Outcome.NAN,
                reason=f"{deciding['kind']} at step {deciding['step']}{micro}, first non-finite at {where}{stopped}",
                diagnosis={**diagnosis, "nan": deciding, "nonfinite_events": len(events)},
            )
        elif steps_run < train["steps"]:  # never ok when the loop ended early, whatever the reason
            self.facts.update(
                outcome=Outcome.ERROR,
                reason=f"stopped after {steps_run} of {train['steps']} steps without a diagnosis",
                diagnosis=diagnosis,
            )
        else:
            # a step the GradScaler skipped ran but changed no weight: say how many updates were applied
            applied = f", {steps_run - skipped} updates applied ({skipped} skipped by the GradScaler)"
            self.facts.update(
                outcome=Outcome.OK,
                reason=f"trained all {steps_run} steps with finite loss" + (applied if skipped else ""),
                diagnosis=diagnosis,
            )


def origin_text(fact: dict[str, Any] | None) -> str:
    """Where a traced non-finite value first appeared, saying when only padding positions held it."""
    if not fact:
        return "unknown module"
    if fact.get("at") == "padding":
        return f"{fact['module']} (at padding positions only: no loss term, but it reaches the gradients)"
    if fact.get("at") == "unlocated":
        return f"{fact['module']} (in a tensor without token positions; no real position went non-finite)"
    earlier = fact.get("preceded_by")
    if earlier:
        return f"{fact['module']} (after a non-finite value at {earlier['at']} positions of {earlier['module']})"
    return fact["module"]
