"""What a cell's loop accumulates as it goes: a checkpoint saves it, a resume refills it, and the summary
at the end turns it into the cell's facts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class LoopState:
    census: Any  # dtypes seen in forward/backward (step 0)
    headroom: Any  # fp16 headroom of sampled and failing steps
    start: int = 0  # the first step this run trains (after a resume, the checkpoint's)
    last_step: int = -1
    skipped_total: int = 0
    consecutive_skips: int = 0
    step_times: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    steady_peaks: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    nonfinite_events: list[dict[str, Any]] = field(default_factory=list)
    headroom_steps: list[int] = field(default_factory=list)  # the failing steps whose headroom was measured on replay
    stop_event: dict[str, Any] | None = None
    stopped: bool = False  # the loop ended at a non-finite or unsupported step (the ranks' stop, not their end)
    unsupported: list[str] = field(default_factory=list)  # adapter tensors that got no gradient on step 0
    stopped_by_peer: int | None = None  # the step at which another rank's decision ended this rank's loop

    def tallies(self) -> dict[str, list[Any]]:
        """The lists a checkpoint saves, as the same objects (a resume extends them in place)."""
        return {
            "step_times": self.step_times,
            "tokens_per_s": self.tokens_per_s,
            "steady_peaks": self.steady_peaks,
            "losses": self.losses,
            "nonfinite_events": self.nonfinite_events,
            "headroom_steps": self.headroom_steps,
        }
