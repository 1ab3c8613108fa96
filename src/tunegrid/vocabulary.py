"""The words every stage shares, defined once: the grid's axes (one table), the precisions and
quantizations, and a cell's outcomes (the metric names a step writes are tunegrid.outcome.StepMetrics' fields).
The schema's grid keys, `Cell`, a cell id and its parser, the Snakefile's wildcard pattern, the summary's
axis columns and the report's plot layout are all derived from AXIS_TABLE (tests/house/test_vocabulary.py),
so a new axis is one row here plus its effect where it acts (the cell spec, the trainer). Light module: no
imports beyond the standard library (the Snakefile reads it at parse time).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Precision(StrEnum):
    """Compute precision of a cell. A StrEnum: each member equals its name as written in configs and ids."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP16_ISLANDS = (
        "fp16-islands"  # fp16 with the modules that overflow it computing in fp32 (cell/nonfinite/islands.py)
    )
    FP16_MIXED = "fp16-mixed"  # fp16 matmuls under autocast over fp32-stored weights (fp32 master weights)
    FP16_RESIDUAL = "fp16-residual"  # fp16 weights and matmuls, the residual stream kept in fp32


class Quant(StrEnum):
    """Base-weight quantization of a cell; what each one loads, audits and estimates is its row of
    tunegrid.meanings.QUANT_ROWS."""

    NONE = "none"
    NF4 = "nf4"
    NF4_EXPERTS = "nf4-experts"
    INT8 = "int8"
    INT8_EXPERTS = "int8-experts"


PRECISIONS = tuple(p.value for p in Precision)
QUANTS = tuple(q.value for q in Quant)
OPTIMIZERS = ("adamw", "adamw-8bit", "paged-adamw-8bit")  # torch's AdamW; bitsandbytes' 8-bit, unpaged and paged
LOSSES = (
    "full",
    "chunked",
)  # train.loss: the model's own loss over all logits, or chunked (cell/memory/chunked_loss.py)
# model config keys of a post-processing of the logits that the chunked loss does not reproduce (Cohere, Granite)
SCALED_LOGIT_KEYS = ("logit_scale", "logits_scaling")
ATTENTIONS = ("sdpa", "eager")  # transformers' attn_implementation: its default kernel (sdpa), or eager
# the rank faults a cell injects (slow-link: a rate limit on the link of the node that holds a rank)
FAULTS = ("debug", "none", "slow-rank", "stall-rank", "skip-collective", "kill-rank", "slow-link")
NO_FAULT = FAULTS[1]  # the twin without an injected fault
DEFAULT_COLLECTIVE_TIMEOUT_S = 600  # PyTorch's NCCL default (Timeout(ms)=600000)
BASE_STACK = "base"  # the stack axis's neutral value (ids `_stack-<name>` elsewhere): the environment tunegrid runs in


class MatrixPlace(StrEnum):
    """Where an axis sits in the report's outcome matrix."""

    ROW = "row"
    COLUMN = "column"


class CurvePlace(StrEnum):
    """How an axis tells loss curves apart: a panel of its own, a line colour or a line style."""

    PANEL = "panel"
    COLOUR = "colour"
    STYLE = "style"


@dataclass(frozen=True, kw_only=True)
class PlotRole:
    """An axis's place in the report's figures. `always`: shown even where the grid holds one value."""

    matrix: MatrixPlace
    curves: CurvePlace
    always: bool = False


@dataclass(frozen=True, kw_only=True, eq=False)  # hashed by identity: a Cell class is cached per table
class Axis:
    """One axis of the grid: everything every stage needs to know about it.

    `id_prefix`: what precedes the value in the cell id (`bs` in `bs8`). `neutral`: the value a cell ran at
    before the axis existed; at it the id leaves the axis out (old ids and results stay valid) and results
    that lack the axis read as it. None: the axis is always in the id and every result has it.
    `items`: the JSON schema of one value (the grid's schema is built from it). `plot`: its place in the
    report's figures; None for an axis the figures cannot show (they refuse a grid where it varies).
    """

    name: str
    type: type
    items: dict[str, Any]
    description: str
    default: tuple[Any, ...] | None = None  # None: the study must list it
    id_prefix: str = ""
    neutral: Any = None
    plot: PlotRole | None = None

    def id_part(self, value: Any) -> str:
        """This axis's part of a cell id, empty at the neutral value (a flag: its prefix alone when set)."""
        if self.neutral is not None and value == self.neutral:
            return ""
        if self.type is bool:
            return self.id_prefix
        return f"{self.id_prefix}{value:g}" if self.type is float else f"{self.id_prefix}{value}"

    def value_pattern(self) -> str:
        if self.type is bool:
            return ""  # a flag: the prefix alone says it is set
        if "enum" in self.items:
            return "|".join(re.escape(str(v)) for v in self.items["enum"])
        if self.type is int:
            return "[0-9]+"
        return "[A-Za-z0-9][A-Za-z0-9.-]*"  # a name (#/definitions/name): no underscore, the id's separator


def _enum(values: tuple[str, ...]) -> dict[str, Any]:
    return {"enum": list(values)}


# The grid's axes, in cell-id order. A new axis is a row here (appended, with a neutral value, so existing
# ids and results stay valid) plus its effect where it acts.
AXIS_TABLE: tuple[Axis, ...] = (
    Axis(
        name="model",
        type=str,
        items={"$ref": "#/definitions/name"},
        description="model names from `models`",
        plot=PlotRole(matrix=MatrixPlace.ROW, curves=CurvePlace.PANEL, always=True),
    ),
    Axis(
        name="precision",
        type=str,
        items=_enum(PRECISIONS),
        description=(
            "compute precision (bf16/fp16 use autocast; fp16 adds a GradScaler); fp16-islands is fp16 with the "
            "modules whose activations near fp16's 65504 computing and returning fp32 (train.fp32_islands); "
            "fp16-mixed keeps the weights that are not quantized in fp32 under fp16 autocast (mixed precision with "
            "fp32 master weights); fp16-residual keeps fp16 weights but the residual stream in fp32"
        ),
        default=(Precision.FP32.value,),
        plot=PlotRole(matrix=MatrixPlace.COLUMN, curves=CurvePlace.COLOUR, always=True),
    ),
    Axis(
        name="batch_size",
        type=int,
        items={"type": "integer", "minimum": 1, "maximum": 4096},
        description="sequences per forward/backward (the micro-batch; per rank); see grad_accum",
        default=(2,),
        id_prefix="bs",
        plot=PlotRole(matrix=MatrixPlace.COLUMN, curves=CurvePlace.PANEL, always=True),
    ),
    Axis(
        name="quant",
        type=str,
        items=_enum(QUANTS),
        description=(
            "base-weight quantization. none: plain LoRA; nf4: QLoRA through BitsAndBytesConfig (bitsandbytes "
            "replaces nn.Linear only, so fused 3-D MoE experts stay in full precision); nf4-experts: nf4 plus "
            "NF4 quantization of every >=3-D expert parameter as the checkpoint is read; int8: bitsandbytes "
            "8-bit (LLM.int8) base weights through BitsAndBytesConfig(load_in_8bit), nn.Linear only; "
            "int8-experts: int8 plus row-wise int8 of every >=3-D expert parameter after the load, dequantized "
            "to fp32 on use (axolotl's quantize_moe_experts with load_in_8bit)"
        ),
        default=(Quant.NF4.value,),
        plot=PlotRole(matrix=MatrixPlace.ROW, curves=CurvePlace.STYLE, always=True),
    ),
    Axis(
        name="seed",
        type=int,
        items={"type": "integer", "minimum": 0},
        description="training seeds (data order, LoRA init, dropout)",
        default=(0,),
        id_prefix="s",
        plot=PlotRole(matrix=MatrixPlace.ROW, curves=CurvePlace.PANEL),
    ),
    Axis(
        name="world_size",
        type=int,
        items={"type": "integer", "minimum": 1, "maximum": 64},
        description=(
            "processes per cell (DDP over the LoRA parameters; gloo on CPU, NCCL on GPU, one GPU per rank). "
            "batch_size is per rank. Cells with world_size > 1 get `_ws<N>` appended to their id"
        ),
        default=(1,),
        id_prefix="ws",
        neutral=1,
        plot=PlotRole(matrix=MatrixPlace.ROW, curves=CurvePlace.PANEL),
    ),
    Axis(
        name="nodes",
        type=int,
        items={"type": "integer", "minimum": 1, "maximum": 64},
        description=(
            "nodes a cell's ranks run on (world_size / nodes ranks per node; on SLURM the cell's job asks for that "
            "many nodes and starts each rank with srun on its node). Cells with nodes > 1 get `_nodes<N>` appended "
            "to their id"
        ),
        default=(1,),
        id_prefix="nodes",
        neutral=1,
        plot=PlotRole(matrix=MatrixPlace.ROW, curves=CurvePlace.PANEL),
    ),
    Axis(
        name="grad_accum",
        type=int,
        items={"type": "integer", "minimum": 1, "maximum": 1024},
        description=(
            "gradient accumulation: micro-batches of batch_size per optimizer step, so the effective batch is "
            "batch_size x grad_accum (x world_size). The loss is normalised over the loss tokens of the whole "
            "effective batch, so 2 x 4 trains the same recipe as 8 x 1 with the activations of 2. Cells with "
            "grad_accum > 1 get `_ga<N>` appended to their id"
        ),
        default=(1,),
        id_prefix="ga",
        neutral=1,
        plot=PlotRole(matrix=MatrixPlace.COLUMN, curves=CurvePlace.PANEL),
    ),
    Axis(
        name="optimizer",
        type=str,
        items=_enum(OPTIMIZERS),
        description=(
            "adamw: torch.optim.AdamW (two fp32 moments per trainable parameter); adamw-8bit: bitsandbytes "
            "AdamW8bit (both moments blockwise-quantized to 8 bits, one fp32 absmax per 256 elements; tensors "
            "under 4096 elements keep fp32 moments); paged-adamw-8bit: bitsandbytes PagedAdamW8bit, the 8-bit "
            "state of tensors of 1e5 elements or more in CUDA managed memory that the driver pages out to host "
            "memory under pressure (on a CPU ordinary memory: nothing to page to). Cells other than adamw get "
            "`_<optimizer>` appended to their id"
        ),
        default=("adamw",),
        neutral="adamw",
        plot=PlotRole(matrix=MatrixPlace.ROW, curves=CurvePlace.PANEL),
    ),
    Axis(
        name="activation_checkpointing",
        type=bool,
        items={"type": "boolean"},
        description=(
            "recompute each layer's activations in backward instead of keeping them (saves activation memory, "
            "costs about one more forward; not a model checkpoint). At false a cell follows "
            "train.gradient_checkpointing. Cells with true get `_ac` appended to their id"
        ),
        default=(False,),
        id_prefix="ac",
        neutral=False,
        plot=PlotRole(matrix=MatrixPlace.COLUMN, curves=CurvePlace.PANEL),
    ),
    Axis(
        name="collective_timeout_s",
        type=float,
        items={"type": "number", "exclusiveMinimum": 0},
        description=(
            "the torch.distributed timeout of every collective, per cell (a twin with a larger one proves or "
            "refutes raising it). At 600 a cell follows distributed.collective_timeout_s. Cells other than 600 s "
            "get `_ct<seconds>` appended to their id"
        ),
        default=(DEFAULT_COLLECTIVE_TIMEOUT_S,),
        id_prefix="ct",
        neutral=DEFAULT_COLLECTIVE_TIMEOUT_S,
        plot=PlotRole(matrix=MatrixPlace.COLUMN, curves=CurvePlace.PANEL),
    ),
    Axis(
        name="fault",
        type=str,
        items=_enum(FAULTS),
        description=(
            "which rank faults of the debug section a cell injects: debug = all it sets; slow-rank, stall-rank, "
            "skip-collective, kill-rank, slow-link = that one alone; none = none (the twin without the fault). "
            "Cells other than debug get `_fault-<value>` appended to their id"
        ),
        default=("debug",),
        id_prefix="fault-",
        neutral="debug",
        plot=PlotRole(matrix=MatrixPlace.ROW, curves=CurvePlace.PANEL),
    ),
    Axis(
        name="repeat",
        type=int,
        items={"type": "integer", "minimum": 0, "maximum": 9},
        description="the same cell run again, same seed (tunegrid doctor's re-run: deterministic or transient?)",
        default=(0,),
        id_prefix="rep",
        neutral=0,
        plot=PlotRole(matrix=MatrixPlace.ROW, curves=CurvePlace.PANEL),
    ),
    Axis(
        name="attention",
        type=str,
        items=_enum(ATTENTIONS),
        description=(
            "the attention kernel (attn_implementation): sdpa = the model's default; eager = its own matmul-softmax "
            "(advised by transformers for training Gemma; keeps the seq x seq probabilities). Cells other than "
            "sdpa get `_attn-<value>` appended to their id"
        ),
        default=("sdpa",),
        id_prefix="attn-",
        neutral="sdpa",
        plot=PlotRole(matrix=MatrixPlace.COLUMN, curves=CurvePlace.PANEL),
    ),
    Axis(
        name="stack",
        type=str,
        items={"$ref": "#/definitions/name"},
        description="base: the environment tunegrid runs in; else a name under `stacks` (its venv runs the worker)",
        default=(BASE_STACK,),
        id_prefix="stack-",
        neutral=BASE_STACK,
        plot=PlotRole(matrix=MatrixPlace.COLUMN, curves=CurvePlace.PANEL),
    ),
    Axis(
        name="loss",
        type=str,
        items=_enum(LOSSES),
        description=(
            "how the loss is taken: full = the model's own, over every token's fp32 logits; chunked = the same "
            "loss, the output head and cross entropy over train.loss_chunk_tokens loss tokens at a time, each "
            "chunk rebuilt in backward (one chunk's logits at once). At full a cell follows train.loss. Cells "
            "other than full get `_loss-<value>` appended to their id"
        ),
        default=(LOSSES[0],),
        id_prefix="loss-",
        neutral=LOSSES[0],
        plot=PlotRole(matrix=MatrixPlace.COLUMN, curves=CurvePlace.PANEL),
    ),
)

AXES = tuple(axis.name for axis in AXIS_TABLE)  # kept for readers that need the names only


def axis_table() -> tuple[Axis, ...]:
    """The table as it is now (read at call time, so a test may extend it)."""
    return AXIS_TABLE


def axis(name: str) -> Axis:
    for row in axis_table():
        if row.name == name:
            return row
    raise KeyError(f"{name!r} is not an axis; axes: {[a.name for a in axis_table()]}")


def axis_names() -> tuple[str, ...]:
    return tuple(a.name for a in axis_table())


def with_neutrals(axes: dict[str, Any]) -> dict[str, Any]:
    """A cell's axes as recorded, completed with the neutral value of every axis it predates."""
    return {**{a.name: a.neutral for a in axis_table() if a.neutral is not None}, **axes}


def format_cell_id(axes: dict[str, Any]) -> str:
    """A readable slug of a cell's axes, e.g. `gemma3-tiny_fp16_bs8_nf4_s0` (`_ws2`, `_ga4` where not 1)."""
    return "_".join(part for row in axis_table() if (part := row.id_part(axes[row.name])))


def cell_id_pattern(named: bool = False) -> str:
    """The regex of a cell id (Snakemake's wildcard constraint), from the table; `named`: a group per axis."""
    pattern = ""
    for row in axis_table():
        value = f"(?P<{row.name}>{row.value_pattern()})" if named else f"({row.value_pattern()})"
        part = f"{'_' if pattern else ''}{row.id_prefix}{value}"
        pattern += f"({part})?" if row.neutral is not None else part
    return pattern


def parse_cell_id(cell_id: str) -> dict[str, Any]:
    """A cell id's axes (typed, neutral values where the id leaves an axis out); ValueError if it is none."""
    found = re.fullmatch(cell_id_pattern(named=True), cell_id)
    if found is None:
        raise ValueError(f"{cell_id!r} is not a cell id (e.g. gemma3-tiny_fp16_bs8_nf4_s0)")
    return {row.name: _parsed(row, found[row.name]) for row in axis_table()}


def _parsed(row: Axis, text: str | None) -> Any:
    if text is None:
        return row.neutral
    return (not row.neutral) if row.type is bool else row.type(text)


class Outcome(StrEnum):
    """How a cell ended. A StrEnum: each member equals its string, as written in result.json and tags."""

    OK = "ok"  # every step trained with finite loss and correct gradients
    NAN = "nan"  # a non-finite loss or gradient ended it (or too many GradScaler skips in a row)
    OOM = "oom"  # an allocation failed, at load or in a step
    PREDICTED_OOM = "predicted_oom"  # not started: the estimate exceeds the budget and the study says skip
    TIMEOUT = "timeout"  # the wall-clock limit, no progress, or a collective that never completed
    ERROR = "error"  # anything else: a bug, a crash, a missing autograd kernel; never retried as ok
    UNSUPPORTED = "unsupported"  # not started: the target cannot run this precision or world size


OUTCOMES = tuple(outcome.value for outcome in Outcome)
FAILED = frozenset(OUTCOMES) - {Outcome.OK}
