"""Model building blocks: linears (packed, quantized, FP8), norms and rotary, vocabulary-parallel layers, MoE."""
