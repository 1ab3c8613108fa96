"""Why a cell ended as it did, typed: result.json's `diagnosis` (Diagnosis), and the parts of it that the summary,
the run tags and the report read (a non-finite event, an out-of-memory, a collective timeout, a rank crash), each
a dataclass with the facts read from it. A part keeps the record it was read from (`record`) and writes it back as
it was, so result.json keeps its keys and files of every earlier version read.

Light module: standard library only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any


def _empty() -> dict[str, Any]:
    return {}


@dataclass(frozen=True, kw_only=True)
class NanDiagnosis:
    """The non-finite event that decided a `nan` cell (events.jsonl's record of it)."""

    step: int
    kind: str  # loss_nonfinite, grad_nonfinite, scaler_skip, ...
    micro_batch: int | None = None  # the micro-batch it happened in (grad_accum > 1)
    forward_origin: dict[str, Any] | None = None  # the first module whose forward output was non-finite
    backward_origin: dict[str, Any] | None = None  # ... whose gradient was
    record: dict[str, Any] = field(default_factory=_empty, repr=False)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> NanDiagnosis:
        origin = raw.get("origin") or {}
        return cls(
            step=raw["step"],
            kind=raw["kind"],
            micro_batch=raw.get("micro_batch"),
            forward_origin=origin.get("forward"),
            backward_origin=origin.get("backward"),
            record=raw,
        )


@dataclass(frozen=True, kw_only=True)
class OomDiagnosis:
    """An out-of-memory: the stage it happened in and the meter's figures as it was handled."""

    stage: str | None = None
    peak_bytes: int | None = None
    bytes_at_failure: int | None = None
    reserved_peak_bytes: int | None = None  # CUDA: what a budget caps (the allocated peak can stay under it)
    record: dict[str, Any] = field(default_factory=_empty, repr=False)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> OomDiagnosis:
        return cls(
            stage=raw.get("stage"),
            peak_bytes=raw.get("peak_bytes"),
            bytes_at_failure=raw.get("bytes_at_failure"),
            reserved_peak_bytes=raw.get("reserved_peak_bytes"),
            record=raw,
        )


# the mismatch types of PyTorch's flight recorder that put the ranks in different collectives (MatchState)
RECORDER_MISMATCHES = frozenset(
    {"COLLECTIVE_TYPE_MISMATCH", "SIZE_OR_SYNTAX_MISMATCH", "COLLECTIVE_STATE_MISMATCH", "COLLECTIVE_DTYPE_MISMATCH"}
)


@dataclass(frozen=True, kw_only=True)
class RecorderCollective:
    """One collective the flight recorder's dumps show failing: its process group, name, sequence number, the
    ranks that did not join it and the mismatch type (None: only ranks missing)."""

    group: str
    group_desc: str = ""
    collective: str = ""
    seq: int | None = None
    missing_ranks: list[int] = field(default_factory=list)
    expected_ranks: list[int] = field(default_factory=list)
    state: str = ""
    mismatch: str | None = None

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> RecorderCollective:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})

    def line(self) -> str:
        who = ", ".join(map(str, self.missing_ranks)) or "none"
        kind = f", {self.mismatch}" if self.mismatch else ""
        return f"{self.collective} #{self.seq} in group {self.group_desc or self.group}, missing rank(s) {who}{kind}"


@dataclass(frozen=True, kw_only=True)
class RecorderReading:
    """The flight recorder's dumps as tunegrid.run.recorder_read read them (its docstring defines each status):
    `found` alone may decide a mismatch; `incomplete`, `too_many_mismatches`, `no_dumps` and `failed` are evidence
    marked as what they are. A reading from before the statuses (a `verdict` line of fr_trace's) reads as failed."""

    status: str
    first: RecorderCollective | None = None
    failing_groups: list[RecorderCollective] = field(default_factory=list)
    failing_collectives: int = 0
    ranks_without_dumps: list[int] = field(default_factory=list)
    empty_dumps: list[int] = field(default_factory=list)  # ranks whose dump holds no entry (never reached one)
    note: str = ""
    record: dict[str, Any] = field(default_factory=_empty, repr=False)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> RecorderReading:
        first = raw.get("first")
        return cls(
            status=str(raw.get("status") or "failed"),
            first=RecorderCollective.from_json(first) if first else None,
            failing_groups=[RecorderCollective.from_json(g) for g in raw.get("failing_groups") or []],
            failing_collectives=int(raw.get("failing_collectives") or 0),
            ranks_without_dumps=list(raw.get("ranks_without_dumps") or []),
            empty_dumps=list(raw.get("empty_dumps") or []),
            note=str(raw.get("note") or raw.get("verdict") or ""),
            record=raw,
        )

    @property
    def mismatch(self) -> bool:
        """The ranks were in different collectives, on a complete reading: the one status that may decide."""
        return self.status == "found" and self.first is not None and self.first.mismatch in RECORDER_MISMATCHES

    @property
    def suspect_ranks(self) -> list[int]:
        """The ranks the reading points at: the first failing collective's missing ranks (on a complete or aborted
        reading), the ranks without a dump (on an incomplete one), and ranks whose dump holds no entry."""
        ranks = set(self.empty_dumps) | set(self.ranks_without_dumps)
        if self.status in ("found", "too_many_mismatches") and self.first is not None:
            ranks |= set(self.first.missing_ranks)
        return sorted(ranks) if self.status in ("found", "too_many_mismatches", "incomplete") else []

    def line(self) -> str:
        """One sentence for the reason: the status, then what it found."""
        if self.status == "found" and self.first is not None:
            return f"flight recorder: {self.first.line()}"
        if self.status == "incomplete":
            without = ", ".join(map(str, self.ranks_without_dumps))
            return f"flight recorder incomplete: no readable dump from rank(s) {without}, no verdict"
        if self.status == "too_many_mismatches":
            found = f"; first {self.first.line()}" if self.first is not None else ""
            return f"flight recorder aborted (too many mismatches), no verdict{found}"
        if self.status == "none_failed":
            return "flight recorder: every recorded collective paired up"
        return f"flight recorder {self.status.replace('_', ' ')}: {self.note[:160]}".rstrip(": ")


@dataclass(frozen=True, kw_only=True)
class CollectiveDiagnosis:
    """A distributed cell's collective timeout, as the supervisor diagnosed it from every rank (cell/collective.py)."""

    op: str | None = None
    missing_ranks: list[int] = field(default_factory=list)
    timeout_s: float | None = None
    step: int | None = None
    seq: int | None = None
    kind: str | None = None  # mismatch / straggler / long_pause (None: results from before the kinds)
    last_step_per_rank: Any = None
    straggler: dict[str, Any] | None = None  # the rank slower than the rest before the stall (evidence)
    parted_ranks: list[int] = field(default_factory=list)  # ranks that left the others (evidence)
    parted_at_step: int | None = None
    recorder: RecorderReading | None = None  # the flight recorder's reading (GPU), with its status
    early: dict[str, Any] | None = None  # the hang as named before the timeout (tunegrid.run.hang_watch)
    record: dict[str, Any] = field(default_factory=_empty, repr=False)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> CollectiveDiagnosis:
        evidence = raw.get("evidence") if isinstance(raw.get("evidence"), dict) else {}
        return cls(
            op=raw.get("op"),
            missing_ranks=list(raw.get("missing_ranks") or []),
            timeout_s=raw.get("timeout_s"),
            step=raw.get("step"),
            seq=raw.get("seq"),
            kind=raw.get("kind"),
            last_step_per_rank=raw.get("last_step_per_rank"),
            straggler=evidence.get("before_the_stall"),
            parted_ranks=list(evidence.get("parted_ranks") or []),
            parted_at_step=evidence.get("parted_at_step"),
            recorder=RecorderReading.from_json(raw["flight_recorder"]) if raw.get("flight_recorder") else None,
            early=raw.get("early"),
            record=raw,
        )


@dataclass(frozen=True, kw_only=True)
class RankCrash:
    """Ranks of a distributed cell that died without writing their facts."""

    ranks: list[int] = field(default_factory=list)
    exit: str = ""
    record: dict[str, Any] = field(default_factory=_empty, repr=False)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> RankCrash:
        return cls(ranks=list(raw.get("ranks") or []), exit=str(raw.get("exit", "")), record=raw)


TYPED_PARTS: dict[str, Any] = {
    "nan": NanDiagnosis,
    "oom": OomDiagnosis,
    "collective": CollectiveDiagnosis,
    "rank_crash": RankCrash,
}


@dataclass(kw_only=True)
class Diagnosis:
    """Why a cell ended as it did, by failure; every part is None where it does not apply.

    nan: the deciding non-finite event (step, kind, origin forward/backward, micro-batch); oom: stage and
    bytes at failure; timeout: the stage and limits in effect; collective: the op, missing ranks and the
    steps each rank reached; rank_crash / rank_failure: the ranks, exit or error, last log lines.
    """

    nan: NanDiagnosis | None = None
    nonfinite_events: int | None = None
    recovered_scaler_skips: dict[str, Any] | None = None
    oom: OomDiagnosis | None = None
    timeout: dict[str, Any] | None = None
    collective: CollectiveDiagnosis | None = None
    collective_timeout: dict[str, Any] | None = None  # a rank's own view; `collective` is the cell's
    peer_lost: dict[str, Any] | None = None
    rank_crash: RankCrash | None = None
    rank_failure: dict[str, Any] | None = None
    params_without_grad: list[str] | None = None
    stopped_by_peer: dict[str, Any] | None = None  # a rank that stopped because another rank's cell ended
    decided_by_rank: int | None = None  # a distributed cell: the rank whose own outcome decided the cell's

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> Diagnosis:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data or {}) - known)
        if unknown:
            raise ValueError(f"diagnosis has keys no Diagnosis field holds: {unknown}; add them to Diagnosis")
        values = dict(data or {})
        for name, part in TYPED_PARTS.items():
            if values.get(name) is not None:
                values[name] = part.from_json(values[name])
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        record = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            record[f.name] = value.record if f.name in TYPED_PARTS else value
        return record

    def replace(self, **changes: Any) -> Diagnosis:
        return dataclasses.replace(self, **changes)
