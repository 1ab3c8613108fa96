"""One cell's training process: load, quantize, attach LoRA, the loop with its instruments, its resume state and
the saved adapter (the worker the finetune rule supervises). The only wing that imports torch (with the
probe).

At this level: the cell's recipe (train), the worker's entry (entry) and the saved adapter (adapters). The rest
in sub-rooms: load (the model, its checkpoint reader, the library APIs, the quantization audit, LoRA attached),
experts (quantized MoE experts and LoRA over them), loop (the step, its instruments and records, the heartbeat,
resume, ranks, faults, precision), memory (offloading, the chunked loss, the optimizers), nonfinite (a non-finite
value's origin, fp32 islands, CPU fp16 matmuls, injection) and data (packing and batches).
"""
