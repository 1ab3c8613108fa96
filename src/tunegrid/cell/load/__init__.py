"""The model a cell trains: read from its checkpoint at its precision and quantization, the library APIs the load
calls checked, what the load really quantized audited, and LoRA attached."""
