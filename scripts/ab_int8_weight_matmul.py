"""INT8 weight-only linears on a CPU: torch's int8 weight-packed matmul against dequantizing once.

Prints microseconds per call, one thread, for float32 activations (against the engine's packed
float32 GEMM, pagedllm.layers.cpu_linear) and bfloat16 activations (against F.linear on bfloat16
weights), at 1, 8 and 32 rows. pagedllm.layers.quantization chose from these numbers.
Usage: .venv/bin/python scripts/ab_int8_weight_matmul.py
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedllm.layers.cpu_linear import packed_linear, packed_linear_choice


def microseconds(call: Callable[[], object], repeats: int = 20) -> float:
    call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    torch.set_num_threads(1)
    choice = packed_linear_choice(torch.float32, torch.device("cpu"))
    print("| out x in | rows | int8pack fp32 | packed fp32 GEMM | int8pack bf16 | bf16 F.linear |")
    print("|---|---|---|---|---|---|")
    for out_features, in_features in ((512, 256), (2048, 2048)):
        weight = torch.randn(out_features, in_features)
        scale = weight.abs().amax(dim=1) / 127
        quantized = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
        dequantized = quantized.float() * scale[:, None]
        packed = packed_linear(dequantized, None, choice) if choice is not None else None
        bf16_weight, bf16_scale = dequantized.bfloat16(), scale.bfloat16()
        for rows in (1, 8, 32):
            x = torch.randn(rows, in_features)
            xb = x.bfloat16()
            cells = [
                microseconds(lambda: torch.ops.aten._weight_int8pack_mm(x, quantized, scale)),
                microseconds(lambda: packed(x) if packed is not None else F.linear(x, dequantized)),
                microseconds(lambda: torch.ops.aten._weight_int8pack_mm(xb, quantized, bf16_scale)),
                microseconds(lambda: F.linear(xb, bf16_weight)),
            ]
            print(f"| {out_features} x {in_features} | {rows} | " + " | ".join(f"{c:.0f} us" for c in cells) + " |")


if __name__ == "__main__":
    main()
