"""Quantized MoE experts: the fused ≥3-D expert parameters quantized as the checkpoint is read, one expert at a time
(NF4, nf4-experts), or once the load is done (row-wise int8, int8-experts), and LoRA trained over NF4 experts."""
