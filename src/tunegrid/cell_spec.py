"""A cell's spec as a type: `CellSpec`, everything one cell trains with, typed section by section (axes, model,
train, lora, data, debug, hardware, distributed, stack). The study's rules make it once
(tunegrid.study.config.cell_spec), every default already filled from the schema
(workflow/schemas/config.schema.yaml) or the axis table (tunegrid.vocabulary.AXIS_TABLE); the contract, the
worker and result.json carry it. Its JSON (`to_json`) is the dict specs/<cell>.json, the plans and result.json's
`cell` hold, key for key.

Reading one (`from_json`) refuses a key no section holds and a section that lacks one, naming the key and its
section: a misspelt key fails where the spec is read, not in a worker. Axes a spec lacks read as their neutral
value (a spec written before the axis existed ran at it). The sections are frozen (no field can be rebound);
the free-form values a section holds (a model's `config`, the debug section's injections) stay JSON dicts.

Light module: standard library only (the Snakefile reads it at parse time).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field, fields, make_dataclass
from typing import Any

from tunegrid.vocabulary import AXIS_TABLE, Axis, axis_table, format_cell_id


class CellAxes:
    """What every Cell is, whichever axes the table holds: its id and its axes as a dict."""

    @property
    def cell_id(self) -> str:
        return format_cell_id(self.axes())

    def axes(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]


@functools.cache
def cell_class(table: tuple[Axis, ...]) -> type[CellAxes]:
    """The Cell dataclass of an axis table: one typed field per axis, its neutral value as the default."""
    required = [(a.name, a.type) for a in table if a.neutral is None]
    optional = [(a.name, a.type, field(default=a.neutral)) for a in table if a.neutral is not None]
    cell = make_dataclass("Cell", [*required, *optional], bases=(CellAxes,), frozen=True, kw_only=True)
    cell.__module__ = __name__
    return cell


# One point of the grid: the axes only (everything else comes from the study); its fields are AXIS_TABLE's.
Cell = cell_class(AXIS_TABLE)


class SpecKeyError(ValueError):
    """A spec whose keys are not its sections' fields: the key and its section are named."""


def _section(cls: type, raw: Any, section: str) -> Any:
    """`cls` from a section's dict holding exactly its fields."""
    if not isinstance(raw, dict):
        raise SpecKeyError(f"cell spec section {section!r}: a mapping of keys, not {type(raw).__name__}")
    known = [f.name for f in fields(cls)]
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise SpecKeyError(f"cell spec section {section!r}: unknown key(s) {unknown}; its keys: {sorted(known)}")
    missing = sorted(set(known) - set(raw))
    if missing:
        raise SpecKeyError(
            f"cell spec section {section!r}: missing key(s) {missing}; a spec is made by the study's rules with "
            "every key filled (tunegrid.study.config.cell_spec)"
        )
    return cls(**raw)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The model the cell fine-tunes: its name under `models` and that entry (schema: models.<name>)."""

    name: str
    source: str  # synthetic / hub / local / gguf
    architecture: str
    config: dict[str, Any]
    seed: int
    init_scale: dict[str, float]
    repo_id: str
    revision: str
    ref: str
    config_overrides: dict[str, Any]
    attn_implementation: str  # "": transformers' default for the model
    allow_pickle: bool
    trust_remote_code: bool
    path: str
    package: str
    sha256: str


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    """How the cell trains (schema: train), with the setting axes written in (gradient_checkpointing, loss)."""

    steps: int
    lr: float
    weight_decay: float
    warmup_steps: int
    lr_scheduler: str
    min_lr_rate: float
    max_grad_norm: float
    seq_len: int
    gradient_checkpointing: bool
    activation_offloading: bool
    loss: str  # full / chunked
    loss_chunk_tokens: int
    weight_offloading: bool
    on_nonfinite: str
    max_consecutive_skips: int
    max_skipped_steps: int
    loss_scale_init: float
    time_limit_s: float
    retries: int
    heartbeat_timeout_s: float
    threads: int
    fp32_islands: str | list[str]  # "auto", or module-name globs
    island_threshold: float
    island_calibration_batches: int
    headroom_every: int
    checkpoint_every: int


@dataclass(frozen=True, kw_only=True)
class LoraSpec:
    """The adapter the cell trains (schema: lora)."""

    r: int
    alpha: float
    dropout: float
    target_modules: list[str]
    target_regex: str  # "": target_modules decide
    target_parameters: list[str]
    modules_to_save: list[str]
    use_rslora: bool
    use_dora: bool
    loftq_bits: int  # 0: no LoftQ
    loftq_iter: int
    prepare_kbit_training: bool


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """The training records (schema: data)."""

    source: str  # synthetic / jsonl / parquet / hub
    examples: int
    seed: int
    path: str
    repo_id: str
    revision: str
    ref: str
    split: str
    data_files: list[str]
    fields: dict[str, str]
    layout: str | dict[str, str]  # "": data.fields decide
    loss_on: str
    packing: bool


@dataclass(frozen=True, kw_only=True)
class DebugSpec:
    """The faults the cell injects (schema: debug, after the grid's `fault` and `repeat` chose them)."""

    inject_nonfinite: dict[str, Any]
    stall_rank: dict[str, Any]  # rank -1: none
    slow_rank: dict[str, Any]
    skip_collective: dict[str, Any]
    kill_rank: dict[str, Any]
    slow_link: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class HardwareSpec:
    """The hardware the cell is judged against (schema: hardware, less mem_mb: the job's request only)."""

    target: str
    memory_budget_gb: float  # 0: the target's memory
    refuse_emulated: bool
    predicted_oom: str  # run / skip
    gpus_per_rank: str | int  # auto / 0 / 1
    oom_margin: float


@dataclass(frozen=True, kw_only=True)
class DistributedSpec:
    """How the cell's ranks work together (schema: distributed), with the collective_timeout_s axis written in."""

    collective_timeout_s: float
    backend: str
    flight_recorder: bool
    trace_buffer_size: int
    exit_grace_s: float
    straggler_factor: float
    straggler_min_lag_s: float
    hang_window_s: float  # 0: derived from the collective timeout
    end_on_hang: bool


@dataclass(frozen=True, kw_only=True)
class StackRef:
    """What a cell's spec records about its stack: enough for its job to find the interpreter."""

    name: str
    pins: dict[str, str]
    key: str
    folder: str  # results/stacks/<key>, relative to the working folder; "" for the base stack
    python: str  # the stack's interpreter, in its folder; "" for the base stack: the job's own

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "pins": dict(self.pins),
            "key": self.key,
            "folder": self.folder,
            "python": self.python,
        }


# the sections a spec holds, each the type of its dict (`stack` only for a cell off the base stack)
SECTIONS: dict[str, type] = {
    "model": ModelSpec,
    "train": TrainSpec,
    "lora": LoraSpec,
    "data": DataSpec,
    "debug": DebugSpec,
    "hardware": HardwareSpec,
    "distributed": DistributedSpec,
}


@dataclass(frozen=True, kw_only=True)
class CellSpec:
    study: str
    cell_id: str
    axes: CellAxes  # the Cell of the axis table
    model: ModelSpec
    train: TrainSpec
    lora: LoraSpec
    data: DataSpec
    debug: DebugSpec
    hardware: HardwareSpec
    distributed: DistributedSpec
    stack: StackRef | None = None  # None: the base stack (the spec then has no `stack` key)

    def to_json(self) -> dict[str, Any]:
        """The spec as specs/<cell>.json, the plans and result.json's `cell` hold it."""
        raw: dict[str, Any] = {"study": self.study, "cell_id": self.cell_id, "axes": self.axes.axes()}
        raw.update({name: asdict(getattr(self, name)) for name in SECTIONS})
        if self.stack is not None:
            raw["stack"] = self.stack.to_json()
        return raw

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> CellSpec:
        """The spec of a spec's dict; a key no section holds, or a section's missing key, is a SpecKeyError."""
        top = {"study", "cell_id", "axes", "stack", *SECTIONS}
        unknown = sorted(set(raw) - top)
        if unknown:
            raise SpecKeyError(f"cell spec: unknown key(s) {unknown}; its keys: {sorted(top)}")
        missing = sorted(top - {"stack"} - set(raw))
        if missing:
            raise SpecKeyError(f"cell spec: missing key(s) {missing}")
        stack = _section(StackRef, raw["stack"], "stack") if "stack" in raw else None
        return cls.of(raw["study"], _axes(raw["axes"]), raw, stack, cell_id=raw["cell_id"])

    @classmethod
    def of(
        cls, study: str, axes: CellAxes, sections: dict[str, Any], stack: StackRef | None, cell_id: str = ""
    ) -> CellSpec:
        """The spec of a cell (`axes`) from its sections' dicts (`sections`, keyed by SECTIONS' names), each
        checked for exactly its section's keys. `cell_id`: as recorded (the axes' id where empty)."""
        typed = {name: _section(kind, sections[name], name) for name, kind in SECTIONS.items()}
        return cls(study=study, cell_id=cell_id or axes.cell_id, axes=axes, stack=stack, **typed)


def _axes(raw: Any) -> CellAxes:
    """The Cell of a spec's axes: an axis the spec lacks is at its neutral value; one the table lacks is refused."""
    table = axis_table()
    if not isinstance(raw, dict):
        raise SpecKeyError(f"cell spec section 'axes': a mapping of keys, not {type(raw).__name__}")
    names = [a.name for a in table]
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise SpecKeyError(f"cell spec section 'axes': unknown key(s) {unknown}; the axes: {names}")
    missing = sorted(a.name for a in table if a.neutral is None and a.name not in raw)
    if missing:
        raise SpecKeyError(f"cell spec section 'axes': missing key(s) {missing}")
    return cell_class(table)(**raw)
