"""The cell's LoRA attachment, audited: what the load quantized, what kbit preparation grew, where the
adapters attached and over which base (4-bit or full precision) they train. Writes audit.json."""

from __future__ import annotations

import sys
from typing import Any

from tunegrid.cell.model import attach_lora
from tunegrid.files import write_json
from tunegrid.plans import quant_plan


class AdaptSteps:
    """Mixin of CellTrainer: the step between loading the model and building the data."""

    spec: dict[str, Any]
    model: Any
    run_dir: Any
    facts: dict[str, Any]

    def audit_and_adapt(self) -> None:
        """Quantization audit after load, optional kbit preparation, LoRA, the expert post-load pass, audit again.

        Writes audit.json; result.json gets its summary.
        """
        from peft import prepare_model_for_kbit_training

        from tunegrid.cell import quant_audit

        quant, lora = quant_plan(self.spec["axes"]["quant"]), self.spec["lora"]
        quantized = quant.quantizes  # any quantization: what it left in full precision is flagged
        report: dict[str, Any] = {
            "quant": quant.quant.value,
            "bits": quant.bits,  # of a quantized base weight, as the plan says; the audit shows the storage
            "after_load": quant_audit.audit_model(self.model, quantization_requested=quantized),
        }
        if quant.experts_quantized:
            from tunegrid.cell.expert_quant import quantized_at_load

            at_load = quantized_at_load(self.model)
        if quantized and lora["prepare_kbit_training"]:
            before = quant_audit.audit_model(self.model, quantization_requested=quantized)
            self.model = prepare_model_for_kbit_training(
                self.model, use_gradient_checkpointing=self.spec["train"]["gradient_checkpointing"]
            )
            report["prepare_kbit_training"] = quant_audit.growth(
                before, quant_audit.audit_model(self.model, quantization_requested=quantized)
            )
        self.model = attach_lora(self.model, self.spec)
        if quant.experts_quantized:
            # the load quantized every expert tensor, those with adapters too; the pass would catch any it missed
            after_load = quant_audit.quantize_experts_post_load(self.model)
            report["expert_quantization"] = {
                "order": "at_load",
                "changed": at_load,
                "changed_after_load": [c["name"] for c in after_load["changed"]],
                "kept_for_lora": after_load["kept_for_lora"],
            }
        report["after_adapters"] = quant_audit.audit_model(self.model, quantization_requested=quantized)
        report["lora"] = quant_audit.lora_attachment(self.model, lora["target_modules"], lora["target_parameters"])
        if report["lora"]["unmatched"]:
            print(
                f"WARNING: LoRA targets matched nothing: {report['lora']['unmatched']} (peft does not warn)",
                file=sys.stderr,
            )
        write_json(self.run_dir / "audit.json", report)
        quant_audit.require_trainable_layout(self.model)  # after every setup forward, before any training
        self.facts["quant_audit"] = {
            "after_load": quant_audit.summarize(report["after_load"]),
            "after_adapters": quant_audit.summarize(report["after_adapters"]),
            "expert_quantization": report.get("expert_quantization"),
            "prepare_kbit_training": report.get("prepare_kbit_training"),
            "lora": report["lora"],
        }
