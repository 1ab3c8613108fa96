"""Checkpoint and resume for a cell's trainer (train.checkpoint_every): what the loop saves every K steps
and how a re-run picks it up. The state itself lives in tunegrid.cell.resume. Mixed into CellTrainer.
"""

from __future__ import annotations

from typing import Any


class CheckpointSteps:
    # ---------------------------------------------------------------- checkpoints and the adapter
    def make_checkpointer(self) -> Any:
        """Single-process cells only: a distributed cell's ranks would each need their own state back."""
        from tunegrid.cell.adapters import base_model_identity
        from tunegrid.cell.resume import Checkpointer, training_key

        every = self.spec["train"].get("checkpoint_every", 0)
        self.facts["checkpoint"] = {"every": every, "applied": not self.ranks.distributed}
        if self.ranks.distributed:
            return None
        return Checkpointer(self.run_dir, every, training_key(self.spec, base_model_identity(self.manifest)))

    def resume(self) -> Any:
        if self.checkpointer is None:
            return None
        resumed = self.checkpointer.restore(self.trainable_named, self.optimizer, self.scheduler, self.scaler)
        if self.checkpointer.discarded:
            self.facts["checkpoint"]["discarded"] = self.checkpointer.discarded
        if resumed is not None:
            self.facts["resumed_from_step"] = resumed.step
            print(f"resuming from the checkpoint of step {resumed.step}", flush=True)
        return resumed

    def refill(self, resumed: Any, tallies: dict[str, list[Any]], census: Any, headroom: Any) -> tuple[int, int, int]:
        """The loop's tallies as they were at the checkpoint: (start step, skipped total, consecutive skips)."""
        saved = resumed.tallies
        for name, values in tallies.items():
            values.extend(saved[name])
        census.forward.update(saved["census"]["forward"])
        census.backward.update(saved["census"]["backward"])
        headroom.worst_seen.update(saved["headroom_worst"])
        self.memory.update(saved["memory"])
        return resumed.step, saved["skipped_total"], saved["consecutive_skips"]

    def save_checkpoint(
        self,
        step: int,
        tallies: dict[str, list[Any]],
        skipped_total: int,
        consecutive_skips: int,
        census: Any,
        headroom: Any,
    ) -> None:
        self.heartbeat.beat(f"step {step} checkpoint")
        extra = {
            "skipped_total": skipped_total,
            "consecutive_skips": consecutive_skips,
            "census": census.as_dict(),
            "headroom_worst": dict(headroom.worst_seen),
            "memory": {k: v for k, v in self.memory.items() if k == "first_step_peak_bytes"},
        }
        self.checkpointer.save(
            step, self.trainable_named, self.optimizer, self.scheduler, self.scaler, {**tallies, **extra}
        )
        self.facts["checkpoint"]["last_step"] = step
