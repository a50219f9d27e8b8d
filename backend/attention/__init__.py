"""Paged attention: backend selection, the step's metadata, KV quantization, and the CPU, compiled and Triton backends."""
