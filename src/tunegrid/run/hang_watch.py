"""A hang named before the collective timeout: while the ranks run, the supervisor watches each rank's heartbeat
and collective position. When no rank has made progress for the hang window and some rank waits in a
collective, it names the hang once -- who is missing, where, and its class so far (mismatch, straggler,
long_pause), read by the same classification the timeout gets (tunegrid.run.collective) from the evidence there
is by then -- so a user at PyTorch's 600 s (or Hugging Face's 1,800 s) timeout learns it in a minute.

Standard library only: the supervisor runs it between its polls.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tunegrid.cell_spec import DistributedSpec
from tunegrid.diagnosis import CollectiveDiagnosis
from tunegrid.run.collective import classify_timeout, collective_position, describe
from tunegrid.run.rank_files import rank_record
from tunegrid.runtime.rundir import last_activity

STEP_RE = re.compile(r"step (\d+)")
MAX_WINDOW_S = 60.0  # at PyTorch's 600 s: named within a minute of the hang
MIN_WINDOW_S = 1.0
STEPS_IN_WINDOW = 3  # never shorter than this many of the plan's predicted steps (a long step is no hang)


def hang_window_s(distributed: DistributedSpec, predicted_step_s: float | None) -> float:
    """distributed.hang_window_s, or where it is 0, a tenth of the collective timeout within [1 s, 60 s], raised to
    three of the plan's predicted steps."""
    if distributed.hang_window_s:
        return float(distributed.hang_window_s)
    window = min(MAX_WINDOW_S, max(MIN_WINDOW_S, float(distributed.collective_timeout_s) / 10))
    return max(window, STEPS_IN_WINDOW * (predicted_step_s or 0.0))


@dataclass
class EarlyVerdict:
    """What the supervisor named while the ranks still ran (result.json: diagnosis.collective.early)."""

    kind: str  # mismatch | straggler | long_pause
    missing_ranks: list[int]
    waiting_ranks: list[int]
    step: int | None
    collective: str
    sentence: str  # tunegrid.run.collective.describe's
    named_at_s: float  # seconds after the ranks started
    quiet_for_s: float  # how long no rank had made progress when it was named
    window_s: float
    evidence: dict[str, Any] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        return asdict(self)

    def reason(self, timeout_s: float) -> str:
        who = ", ".join(map(str, self.missing_ranks)) or "none identified"
        where = f" at step {self.step}" if self.step is not None else ""
        return (
            f"collective hang named after {self.quiet_for_s:.0f} s without progress (before the {timeout_s:g} s "
            f"timeout) in {self.collective}{where}: rank(s) {who} did not arrive; {self.sentence}"
        )


class HangWatch:
    """Names a hang once per cell; `check` between the supervisor's polls."""

    def __init__(self, run_dir: Path, world: int, distributed: DistributedSpec, predicted_step_s: float | None):
        self.run_dir, self.world, self.settings = run_dir, world, distributed
        self.window_s = hang_window_s(distributed, predicted_step_s)
        self.started = time.time()
        self.verdict: EarlyVerdict | None = None

    def announce(self, tracker: Any) -> bool:
        """The named hang said in the cell's log and tagged on its MLflow run at once (True: there is one)."""
        if self.verdict is None:
            return False
        said = self.verdict.reason(float(self.settings.collective_timeout_s))
        print(said, flush=True)
        tracker.tag({"collective.early": said[:4000], "collective.early_kind": self.verdict.kind})
        return True

    def check(self, exit_codes: list[int | None], now: float | None = None) -> EarlyVerdict | None:
        """The verdict the moment it is named (None before, and after: it is named once). No rank may have
        ended: a rank that ended is the supervisor's to read (a crash, or the end of training)."""
        now = time.time() if now is None else now
        if self.verdict is not None or any(code is not None for code in exit_codes):
            return None
        quiet = now - last_activity(self.run_dir, self.started, self.world)
        if quiet < self.window_s:
            return None
        ranks = [rank_record(self.run_dir, rank, None, False) for rank in range(self.world)]
        positions = {r["rank"]: p for r in ranks if (p := collective_position(r)) is not None}
        if not positions:
            return None  # no rank waits in a collective: the heartbeat timeout's to judge
        waiting = sorted(positions)
        missing = [r["rank"] for r in ranks if r["rank"] not in positions]
        step, collective = max(positions.values(), key=lambda p: list(positions.values()).count(p))
        timeout_s, factor = float(self.settings.collective_timeout_s), float(self.settings.straggler_factor)
        lag = float(self.settings.straggler_min_lag_s)
        kind = classify_timeout(ranks, missing, step, timeout_s, factor, None, lag)
        if not missing and kind["kind"] != "mismatch":
            # every heartbeat names the same step's collective (a rank slowed down inside its step wrote it
            # before): the straggler, where the local times show one, else the rank whose last sign of life is
            # the oldest, has not reached it
            missing = [kind["rank"]] if kind["kind"] == "straggler" else [oldest(ranks)]
            kind = classify_timeout(ranks, missing, step, timeout_s, factor, None, lag)
        waiting = [r for r in waiting if r not in missing]
        if kind["kind"] == "mismatch":
            missing = kind["parted_ranks"]
            waiting = [r for r in waiting if r not in missing]
            step, collective = kind["main_path"]["step"], kind["main_path"]["collective"]
        self.verdict = EarlyVerdict(
            kind=kind["kind"],
            missing_ranks=missing,
            waiting_ranks=waiting,
            step=step,
            collective="BARRIER" if collective == "barrier" else "ALLREDUCE",
            sentence=describe(kind),
            named_at_s=round(now - self.started, 2),
            quiet_for_s=round(quiet, 2),
            window_s=self.window_s,
            evidence=kind,
        )
        return self.verdict


def ended_on_hang(early: EarlyVerdict, ranks: list[dict[str, Any]], timeout_s: float) -> CollectiveDiagnosis:
    """result.json's collective diagnosis of a cell ended on its named hang (distributed.end_on_hang): the early
    verdict is the verdict, and the ranks' last positions its evidence."""
    return CollectiveDiagnosis(
        op=early.collective,
        waiting_ranks=early.waiting_ranks,
        missing_ranks=early.missing_ranks,
        missing_from="hang_watch",
        timeout_s=timeout_s,
        step=early.step,
        seq=None,
        last_step_per_rank={r["rank"]: r["last_step"] for r in ranks},
        last_heartbeat_per_rank={r["rank"]: r["last_heartbeat"] for r in ranks},
        message=early.reason(timeout_s),
        kind=early.kind,
        evidence=early.evidence,
        early=early.record(),
    )


def oldest(ranks: list[dict[str, Any]]) -> int:
    """The rank whose heartbeat was written the longest ago."""
    return int(min(ranks, key=lambda r: r["last_heartbeat_at"] or 0.0)["rank"])


def compared(early: EarlyVerdict, final_kind: str | None, final_missing: list[int]) -> dict[str, Any]:
    """The early verdict beside the one the timeout gave (result.json: diagnosis.collective.early)."""
    return {
        **early.record(),
        "same_kind": early.kind == final_kind,
        "same_missing_ranks": sorted(early.missing_ranks) == sorted(final_missing or []),
    }
