"""A finished cell's product: its LoRA adapter, saved with peft under <run>/adapter/.

Beside peft's files (adapter_config.json, adapter_model.safetensors) the folder holds base_model.json,
which names the base checkpoint the adapter belongs to (hub repo id and revision, or the manifest
digest of a local or synthetic checkpoint) and how it was loaded, and reference_batch.safetensors with
the loss the cell's final weights give on it: loading the adapter onto that base and evaluating the
batch must give the same loss, which is how a copy is checked.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from tunegrid.cell_spec import CellSpec
from tunegrid.runtime.files import open_to_umask, write_json

ADAPTER_DIR = "adapter"
BASE_FILE = "base_model.json"
REFERENCE_BATCH_FILE = "reference_batch.safetensors"


def base_model_identity(manifest: dict[str, Any]) -> dict[str, Any]:
    """Which base checkpoint: the manifest's sha256 always (it lists every file's sha256), the hub
    coordinates when it came from the hub, the GGUF's package, version or path and sha256 when from one. The
    manifest's `cache` is left out of its sha256: whether the files were taken from tunegrid's cache or made
    afresh, they are the same files, so an adapter (and a resume state) keeps its base either way."""
    which = {key: value for key, value in manifest.items() if key != "cache"}
    text = json.dumps(which, sort_keys=True, separators=(",", ":"))
    source = manifest.get("source") or {}
    identity: dict[str, Any] = {
        "kind": source.get("kind"),
        "manifest_sha256": hashlib.sha256(text.encode()).hexdigest(),
    }
    if source.get("kind") == "hub":
        identity.update(repo_id=source["repo_id"], revision=source["revision"])
    if source.get("kind") == "gguf":  # the quantized file the weights were dequantized from
        identity.update({k: source[k] for k in ("package", "version", "path", "gguf_sha256") if k in source})
    return identity


def reference_loss(model: Any, batch: dict[str, Any], autocast: Any) -> float:
    """The loss of `batch` with dropout off and no gradient: what a reloaded adapter must reproduce."""
    import torch

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast:
            return float(model(**batch).loss.float().item())
    finally:
        model.train(was_training)


def save_adapter(run_dir: Path, model: Any, batch: dict[str, Any], loss: float, base: dict[str, Any]) -> dict[str, Any]:
    """peft save_pretrained (safetensors) plus base_model.json and the reference batch, swapped in by rename."""
    from safetensors.torch import save_file

    staging = run_dir / f".{ADAPTER_DIR}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in batch.items()}, str(staging / REFERENCE_BATCH_FILE))
    record = {
        **base,
        "reference": {"batch_file": REFERENCE_BATCH_FILE, "loss": loss, "mode": "eval (dropout off), no grad"},
    }
    write_json(staging / BASE_FILE, record)
    open_to_umask(staging)  # safetensors writes its files 0600
    target = run_dir / ADAPTER_DIR
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)
    return {"path": ADAPTER_DIR, "files": sorted(p.name for p in target.iterdir()), **record}


def base_record(
    spec: CellSpec, manifest: dict[str, Any], precision: Any, fp32_islands: list[str] | None = None
) -> dict[str, Any]:
    """Everything needed to rebuild the base the adapter was trained on: for a 4-bit cell, BitsAndBytesConfig's
    arguments too, and that its 4-bit layers kept bitsandbytes' training layout (on a CPU with AVX512-BF16 a
    no-grad eval forward otherwise repacks them for another kernel, which rounds differently)."""
    from tunegrid.cell.load.model import bnb_settings
    from tunegrid.meanings import quant_row

    load = {
        "storage_dtype": precision.storage_dtype,
        "compute_dtype": precision.compute_dtype,
        "quant": spec.axes.quant,
    }
    quant = quant_row(spec.axes.quant)
    if quant.record_key:
        load[quant.record_key] = bnb_settings(spec, precision)
        load["cpu_inference_packing"] = False  # Linear4bit.support_avx512bf16_for_cpu = False on every layer
    import torch

    if not torch.backends.mkldnn.enabled:  # a CPU MoE cell (bf16; fp16 where oneDNN runs it) trained without oneDNN
        load["cpu_onednn"] = False  # (cell.load.model.use_cpu_kernels): they round differently, so a reload matches
    from tunegrid.cell.nonfinite.fp16_matmul import installed

    if (
        installed()
    ):  # a CPU fp16 cell's matmuls summed in fp32 (cell.nonfinite.fp16_matmul): a reload computes them alike
        load["cpu_fp16_matmul"] = "fp32-sums"
    if fp32_islands:  # fp16-islands: these modules computed and returned fp32 (cell/nonfinite/islands.make_island)
        load["fp32_islands"] = list(fp32_islands)
    if spec.lora.loftq_bits:  # the adapted weights were replaced by their LoftQ round trip
        load["loftq"] = {"bits": spec.lora.loftq_bits, "iter": spec.lora.loftq_iter}
    return {
        "base_model": base_model_identity(manifest),
        "model_name": spec.model.name,
        "cell_id": spec.cell_id,
        "load": load,
    }


def load_adapter(model: Any, adapter_dir: Path) -> Any:
    """The adapter saved under `adapter_dir`, put on `model` (the base as the cell loaded it, or in full
    precision) for evaluation, with its adapters on 4-bit expert tensors nested and run as in training
    (cell/experts/lora.py; peft's from_pretrained nests them in another order on a 4-bit base)."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    from tunegrid.cell.experts.lora import adopt_quantized_experts, nest_in_declared_order

    config = LoraConfig.from_pretrained(str(adapter_dir))
    config.inference_mode = True
    adapted = get_peft_model(model, config)
    nest_in_declared_order(adapted.base_model.model)
    adopt_quantized_experts(adapted)
    loaded = set_peft_model_state_dict(adapted, load_file(str(Path(adapter_dir) / "adapter_model.safetensors")))
    missing = [k for k in loaded.missing_keys if ".lora_" in k]
    if loaded.unexpected_keys or missing:
        raise ValueError(
            f"the adapter in {adapter_dir} does not fit this model: unexpected {loaded.unexpected_keys[:3]}, "
            f"missing {missing[:3]}; load the base the adapter's base_model.json names"
        )
    return adapted.eval()
