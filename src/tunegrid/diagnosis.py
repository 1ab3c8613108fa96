"""Why a cell ended as it did, typed: result.json's `diagnosis` (Diagnosis), and the parts of it a producer builds
and the summary, the run tags and the report read (a non-finite event, an out-of-memory, a timeout, a collective
timeout, a rank crash), each a dataclass whose fields are the record's keys. Producers construct the parts and
write them with `to_json`; a record of an earlier version reads with the keys it lacked left out again and the keys
no field names kept, so result.json keeps its keys and files of every version read and write back as they were.

Light module: standard library only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any, ClassVar


def _empty() -> dict[str, Any]:
    return {}


class NonfiniteKind(StrEnum):
    """What went non-finite in a step (events.jsonl's `kind`). A StrEnum: each member equals its string."""

    LOSS = "loss_nonfinite"  # the loss itself
    GRADIENT = "grad_nonfinite_finite_loss"  # a finite loss whose gradient is not (no GradScaler)
    SCALER_SKIP = "scaler_skip"  # fp16: the GradScaler found a non-finite gradient and skipped the update


@dataclass(frozen=True, kw_only=True)
class Part:
    """A typed part of the diagnosis: its fields, in the order they are written, are the record's keys.
    `absent`: the fields the record read did not hold (an earlier version's), left out again when written;
    `extra`: the keys of such a record no field names, written back as read."""

    extra: dict[str, Any] = field(default_factory=_empty, repr=False)
    absent: frozenset[str] = field(default=frozenset(), repr=False, compare=False)
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset()  # fields a producer writes only when they hold a value
    NESTED: ClassVar[dict[str, Any]] = {}  # fields that hold a typed record of their own: its from_json

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name not in ("extra", "absent")]

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Any:
        names = cls.keys()
        values = {k: cls.NESTED[k](raw[k]) if k in cls.NESTED and raw[k] else raw[k] for k in names if k in raw}
        extra = {k: v for k, v in raw.items() if k not in names}
        return cls(**values, absent=frozenset(n for n in names if n not in raw), extra=extra)

    def omitted(self) -> set[str]:
        """The fields this part does not write: those its record lacked, and the unset ones of OMIT_NONE."""
        return set(self.absent) | {n for n in self.OMIT_NONE if getattr(self, n) is None}

    def to_json(self) -> dict[str, Any]:
        left_out = self.omitted()
        record = {}
        for name in self.keys():
            if name not in left_out:
                value = getattr(self, name)
                record[name] = value.to_json() if hasattr(value, "to_json") else value
        return {**record, **self.extra}


@dataclass(frozen=True, kw_only=True)
class NanDiagnosis(Part):
    """A non-finite event (events.jsonl's record of it); as diagnosis.nan, the one that decided a `nan` cell.
    An event without its origin (a repeat of a kind already traced) has no micro-batch nor headroom either."""

    step: int
    kind: NonfiniteKind
    loss: Any = None  # float, or "nan"/"inf" as JSON writes them
    grad_norm: Any = None
    loss_scale: float | None = None
    origin: dict[str, Any] | None = None  # the replay's trace: forward / backward module, micro_batch, ...
    micro_batch: int | None = None  # the micro-batch it happened in (grad_accum > 1)
    headroom: dict[str, Any] | None = None  # fp16 headroom measured on the replay of the failing step

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> NanDiagnosis:
        part = super().from_json(raw)
        return dataclasses.replace(part, kind=NonfiniteKind(part.kind))

    def omitted(self) -> set[str]:
        untraced = {"origin", "micro_batch", "headroom"} if self.origin is None else set()
        return super().omitted() | untraced

    @property
    def forward_origin(self) -> dict[str, Any] | None:
        """The first module whose forward output was non-finite."""
        return (self.origin or {}).get("forward")

    @property
    def backward_origin(self) -> dict[str, Any] | None:
        """... whose gradient was."""
        return (self.origin or {}).get("backward")


@dataclass(frozen=True, kw_only=True)
class OomDiagnosis(Part):
    """An out-of-memory: the stage it happened in and the meter's figures as it was handled (none without one)."""

    stage: str | None = None
    bytes_at_failure: int | None = None
    peak_bytes: int | None = None
    reserved_peak_bytes: int | None = None  # CUDA: what a budget caps (the allocated peak can stay under it)
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"bytes_at_failure", "peak_bytes", "reserved_peak_bytes"})


@dataclass(frozen=True, kw_only=True)
class TimeoutDiagnosis(Part):
    """A cell the supervisor stopped at its time limit or on a silent heartbeat: the stage and the limits in
    effect (the study's raised to the cell's predicted work: the plan's liveness)."""

    stage: str | None = None
    limit_s: float | None = None
    heartbeat_timeout_s: float | None = None
    liveness: dict[str, Any] | None = None


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

    def to_json(self) -> dict[str, Any]:
        return self.record


@dataclass(frozen=True, kw_only=True)
class CollectiveDiagnosis(Part):
    """A distributed cell's collective timeout, as the supervisor diagnosed it from every rank (run/rank_diagnosis.py),
    or the hang it ended the cell on (run/hang_watch.py)."""

    op: str | None = None
    waiting_ranks: list[int] = field(default_factory=list)
    missing_ranks: list[int] = field(default_factory=list)
    missing_from: str | None = None  # logs / flight_recorder / hang_watch: what named the missing ranks
    timeout_s: float | None = None
    step: int | None = None
    seq: int | None = None  # NCCL's watchdog names it; gloo does not report one
    last_step_per_rank: Any = None
    last_heartbeat_per_rank: dict[Any, Any] | None = None
    message: str | None = None
    flight_recorder: RecorderReading | None = None  # the flight recorder's reading (GPU), with its status
    kind: str | None = None  # mismatch / straggler / long_pause (None: results from before the kinds)
    evidence: dict[str, Any] | None = None  # what decided the kind (run/collective.py's classify_timeout)
    early: dict[str, Any] | None = None  # the hang as named before the timeout (tunegrid.run.hang_watch)
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"flight_recorder", "early"})
    NESTED: ClassVar[dict[str, Any]] = {"flight_recorder": RecorderReading.from_json}

    def _evidence(self) -> dict[str, Any]:
        return self.evidence if isinstance(self.evidence, dict) else {}

    @property
    def recorder(self) -> RecorderReading | None:
        return self.flight_recorder

    @property
    def straggler(self) -> dict[str, Any] | None:
        """The rank slower than the rest before the stall (evidence)."""
        return self._evidence().get("before_the_stall")

    @property
    def parted_ranks(self) -> list[int]:
        """Ranks that left the others (evidence)."""
        return list(self._evidence().get("parted_ranks") or [])

    @property
    def parted_at_step(self) -> int | None:
        return self._evidence().get("parted_at_step")

    def replace(self, **changes: Any) -> CollectiveDiagnosis:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, kw_only=True)
class RankCrash(Part):
    """Ranks of a distributed cell that died without writing their facts."""

    ranks: list[int] = field(default_factory=list)
    exit: str = ""
    last_step: int | None = None  # the first crashed rank's
    last_log_lines: str | None = None
    last_step_per_rank: dict[Any, Any] | None = None


TYPED_PARTS: dict[str, Any] = {
    "nan": NanDiagnosis,
    "oom": OomDiagnosis,
    "timeout": TimeoutDiagnosis,
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
    timeout: TimeoutDiagnosis | None = None
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
            record[f.name] = value.to_json() if f.name in TYPED_PARTS else value
        return record

    def replace(self, **changes: Any) -> Diagnosis:
        return dataclasses.replace(self, **changes)
