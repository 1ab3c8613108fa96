"""How long a cell may go without a sign of life, and how long it may run: limits taken from the step's work and
the probe's measured rate, never from the host's speed alone.

A slow step on a slow host is not a hang. The study's `train.heartbeat_timeout_s` and `train.time_limit_s` are
floors; the plan raises them to LIVENESS_MARGIN times what the cell's own work predicts at the rate the probe
measured for its precision's arithmetic (fp16 on a CPU without fp16 units runs matmuls at a small fraction of
fp32's rate, and a real model's step takes minutes there). While the cell trains, the supervisor raises them again
from the step times the cell itself reports (tunegrid.run.supervisor.Liveness), so a host that became slower than
the probe saw is not mistaken for a hang either. A hang makes no progress at all: a single-process worker beats
its heartbeat at every decoder block in forward and backward (tunegrid.cell.loop.liveness), so the silence a hang
leaves is seen within the heartbeat limit, however long a whole step takes.

Light module: standard library only (the estimate's header reader is torch-free).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tunegrid.cell_spec import CellSpec
from tunegrid.contract import LivenessLimits
from tunegrid.meanings import precision_row
from tunegrid.targets import FLOPS_PER_WEIGHT_TOKEN_BOUND, matmul_share

# How many times the predicted (or measured) work a limit allows: room for a host shared with other jobs and for
# the probe's rate, taken from square matmuls, being above what a model's mixed shapes reach.
LIVENESS_MARGIN = 4.0
# Steps' worth of work beyond the training steps: a failing step's traced replay, the fp32 islands' calibration
# forward and the adapter's reference forward.
EXTRA_STEPS = 3
# The limits count every step as if it recomputed its forward (tunegrid.targets.matmul_share: the share a step does)
FLOPS_PER_WEIGHT_TOKEN = FLOPS_PER_WEIGHT_TOKEN_BOUND


def matmul_weights(config: dict[str, Any], shapes: dict[str, list[int]]) -> float:
    """Weights each token is multiplied by in one forward: every 2-D weight but the input embeddings, the LM head
    counted once whether tied or not, and of a MoE's experts the share a token is routed to."""
    config = config.get("text_config") or config
    vocab, hidden = int(config["vocab_size"]), int(config["hidden_size"])
    experts = max(int(config.get(k) or 0) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    routed = int(config.get("num_experts_per_tok") or config.get("num_experts_per_token") or 1)
    total = float(vocab * hidden)  # the LM head (tied to the embeddings in many models, so not in the shapes)
    for name, shape in shapes.items():
        if len(shape) < 2 or not name.endswith(("weight", "proj", "experts")):
            continue
        numel = 1
        for dim in shape:
            numel *= dim
        if len(shape) >= 3 or (experts and ".experts." in name):
            total += numel * routed / max(experts, 1)
        elif shape != [vocab, hidden]:  # the embeddings (a lookup) and an untied LM head (counted above)
            total += numel
    return total


def plan_liveness(
    spec: CellSpec, config: dict[str, Any], shapes: dict[str, list[int]], capabilities: dict[str, Any]
) -> LivenessLimits:
    """The cell's limits: the study's, raised to LIVENESS_MARGIN x the predicted work where that is longer."""
    axes, train = spec.axes, spec.train
    tokens = axes.batch_size * axes.grad_accum * train.seq_len
    flops = FLOPS_PER_WEIGHT_TOKEN * matmul_weights(config, shapes) * tokens
    dtype = precision_row(axes.precision).dtype
    rate = (capabilities.get("matmul_tflops") or {}).get(dtype)  # the probe's rate for the compute dtype
    heartbeat, limit = float(train.heartbeat_timeout_s), float(train.time_limit_s)
    if not rate:
        return LivenessLimits(
            heartbeat_timeout_s=heartbeat,
            time_limit_s=limit,
            predicted_step_s=None,
            step_flops=flops,
            rate_tflops=None,
            margin=LIVENESS_MARGIN,
            extra_steps=EXTRA_STEPS,
            basis="the study's limits (the probe measured no matmul rate for this precision)",
        )
    step_s = flops / (rate * 1e12)
    return LivenessLimits(
        heartbeat_timeout_s=max(heartbeat, LIVENESS_MARGIN * step_s),
        time_limit_s=max(limit, LIVENESS_MARGIN * step_s * (train.steps + EXTRA_STEPS)),
        predicted_step_s=step_s,
        step_flops=flops,
        rate_tflops=rate,
        margin=LIVENESS_MARGIN,
        extra_steps=EXTRA_STEPS,
        basis=(
            f"{flops / 1e9:.0f} GFLOP per step at the probe's {rate:.4g} TFLOP/s ({dtype}) = {step_s:.1f} s; "
            f"limits: the study's, or {LIVENESS_MARGIN:g}x that work where longer"
        ),
    )


def cell_liveness(spec: CellSpec, model_dir: Path, capabilities: dict[str, Any]) -> LivenessLimits:
    """plan_liveness for a cell whose checkpoint is on disk (its config and safetensors headers)."""
    from tunegrid.prepare.checkpoint_headers import tensor_shapes

    config = json.loads((Path(model_dir) / "config.json").read_text())
    return plan_liveness(spec, config, tensor_shapes(model_dir), capabilities)


def step_floor_s(
    step_flops: float, precision: str, checkpointing: bool, capabilities: dict[str, Any]
) -> tuple[float, str] | None:
    """The least time one step of a cell can take on this machine, and how it was found: the matmul FLOPs it cannot
    skip (tunegrid.targets.matmul_share of the limits' FLOPs: without the recomputed forward unless it checkpoints; its
    adapters' and every other operation's work left out) at the rate the probe measured for the arithmetic its
    products run in. Where the probed device only emulates that arithmetic, its products run either in the
    device's own kernel for the dtype (the probe's rate for it) or in fp32 (tunegrid's CPU fp16 products, in fp32
    blocks: tunegrid.cell.nonfinite.fp16_matmul; a GPU without bf16 units), so the faster of the two rates is taken.
    A lower bound, never a prediction: the doctor stops trying fixes whose floor is slower than a fix it has
    measured (review/doctor_stop.py). None without a measured rate."""
    rates = {k: v for k, v in (capabilities.get("matmul_tflops") or {}).items() if v}
    row = precision_row(precision)
    dtype = str(row.dtype)
    support = (capabilities.get("precision") or {}).get(str(row.arithmetic))
    emulated = support != "native"
    rate = max(rates.get(dtype, 0.0), rates.get("float32", 0.0)) if emulated else rates.get(dtype)
    if not rate or not step_flops:
        return None
    share = matmul_share(checkpointing)
    floor = step_flops * share / (rate * 1e12)
    how = f"{dtype} emulated: the faster of its rate and float32's" if emulated else dtype
    return floor, f"{step_flops * share / 1e9:.3g} GFLOP at the probe's {rate:.3g} TFLOP/s ({how})"
