"""The cell's LoRA attachment, audited: what the load quantized, what kbit preparation grew, where the
adapters attached and over which base (4-bit or full precision) they train. Writes audit.json."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tunegrid.cell.load.model import attach_lora
from tunegrid.cell_spec import CellSpec
from tunegrid.meanings import quant_row
from tunegrid.runtime.files import write_json


def audit_and_adapt(model: Any, spec: CellSpec, run_dir: Path) -> tuple[Any, dict[str, Any]]:
    """Quantization audit after load, optional kbit preparation, LoRA, the expert post-load pass, audit again: the
    step between loading the model and building the data.

    Writes audit.json; returns the adapted model and the audit's summary (result.json's `quant_audit`).
    """
    from peft import prepare_model_for_kbit_training

    from tunegrid.cell.load import quant_audit

    quant, lora = quant_row(spec.axes.quant), spec.lora
    quantized = quant.quantizes  # any quantization: what it left in full precision is flagged
    report: dict[str, Any] = {
        "quant": quant.quant.value,
        "bits": quant.bits,  # of a quantized base weight, as its row says; the audit shows the storage
        "after_load": quant_audit.audit_model(model, quantization_requested=quantized),
    }
    nf4_experts = quant.experts_quantized and not quant.experts_after_load
    if nf4_experts:
        from tunegrid.cell.experts.quant import quantized_at_load

        at_load = quantized_at_load(model)
    elif quant.experts_quantized:  # int8-experts: the loader quantized them once the load was done
        from tunegrid.cell.experts.int8 import quantized_experts

        report["expert_quantization"] = {"order": "after_load", "changed": quantized_experts(model)}
    if quantized and lora.prepare_kbit_training:
        before = quant_audit.audit_model(model, quantization_requested=quantized)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=spec.train.gradient_checkpointing)
        report["prepare_kbit_training"] = quant_audit.growth(
            before, quant_audit.audit_model(model, quantization_requested=quantized)
        )
    model = attach_lora(model, spec)
    if nf4_experts:
        # the load quantized every expert tensor, those with adapters too; the pass would catch any it missed
        after_load = quant_audit.quantize_experts_post_load(model)
        report["expert_quantization"] = {
            "order": "at_load",
            "changed": at_load,
            "changed_after_load": [c["name"] for c in after_load["changed"]],
            "kept_for_lora": after_load["kept_for_lora"],
        }
    report["after_adapters"] = quant_audit.audit_model(model, quantization_requested=quantized)
    targets = list(lora.target_modules)
    if targets == ["all-linear"] or lora.target_regex:  # peft resolved it: audit the suffixes it attached to
        targets = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if len(getattr(m, "lora_A", {}))})
        targets = targets or [lora.target_regex or "all-linear"]  # none attached: say what matched nothing
    report["lora"] = quant_audit.lora_attachment(model, targets, lora.target_parameters)
    if report["lora"]["unmatched"]:
        print(
            f"WARNING: LoRA targets matched nothing: {report['lora']['unmatched']} (peft does not warn)",
            file=sys.stderr,
        )
    write_json(run_dir / "audit.json", report)
    quant_audit.require_trainable_layout(model)  # after every setup forward, before any training
    return model, {
        "after_load": quant_audit.summarize(report["after_load"]),
        "after_adapters": quant_audit.summarize(report["after_adapters"]),
        "expert_quantization": report.get("expert_quantization"),
        "prepare_kbit_training": report.get("prepare_kbit_training"),
        "lora": report["lora"],
    }
