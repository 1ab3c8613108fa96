"""Per-step memory growth of a bf16 Qwen3-MoE LoRA loop on CPU: oneDNN, not tunegrid.

A plain transformers + peft loop, no tunegrid code: the default study's qwen3moe-tiny shape (random init),
LoRA on the attention projections, AdamW, 30 steps of fresh 8 x 64 token batches under CPU autocast. It
prints the process's peak RSS (VmHWM) after each step for: fp32 weights; bf16 weights under bf16 autocast
(what a tunegrid bf16 cell does: load.storage_dtype bfloat16); the same with torch.backends.mkldnn
disabled. Each variant runs in a fresh process (RSS is per process):

    python benchmarks/onednn_bf16_growth.py                 # all variants
    ONEDNN_PRIMITIVE_CACHE_CAPACITY=0 python benchmarks/onednn_bf16_growth.py bf16
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

VARIANTS = {"fp32": ("float32", False), "bf16": ("bfloat16", False), "bf16-no-mkldnn": ("bfloat16", True)}


def peak_mib() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) // 1024 for line in fh if line.startswith("VmHWM"))


def run(variant: str, steps: int = 30) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    dtype_name, no_mkldnn = VARIANTS[variant]
    dtype = getattr(torch, dtype_name)
    if no_mkldnn:
        torch.backends.mkldnn.enabled = False
    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = Qwen3MoeConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=8, num_experts_per_tok=2,
        initializer_range=0.2, use_cache=False,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    model = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    peaks, started = [], time.perf_counter()
    for _ in range(steps):
        ids = torch.randint(0, 512, (8, 64))
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        peaks.append(peak_mib())
    seconds = time.perf_counter() - started
    print(f"{variant:15s} peak MiB step 1 {peaks[0]}, step 10 {peaks[9]}, step {steps} {peaks[-1]}; {seconds:.1f} s")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        run(sys.argv[1])
    else:
        for name in VARIANTS:
            subprocess.run([sys.executable, __file__, name], check=True, env=os.environ)
