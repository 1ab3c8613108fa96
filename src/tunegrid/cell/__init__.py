"""One cell's training process: load, quantize, attach LoRA, the loop with its instruments, its resume state and
the saved adapter (the worker the finetune rule supervises). The only wing that imports torch (with the
probe)."""
