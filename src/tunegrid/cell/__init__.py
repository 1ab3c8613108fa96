"""One cell's training process: load, quantize, attach LoRA, the loop with its instruments, checkpoints and
the saved adapter (the worker the finetune rule supervises). The only wing that imports torch (with the
probe)."""
