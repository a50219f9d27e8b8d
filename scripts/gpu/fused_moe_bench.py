"""The fused-MoE Triton kernel against a per-expert loop of torch GEMMs (the grouped CPU path run on the GPU).

Shapes: one Mixtral-8x7B layer (8 experts of 14336, top-2) and one Qwen3-30B-A3B layer (128 experts of 768,
top-8), bf16, at decode batches and a prefill chunk. Checks the kernel against the loop first, then times both
with triton.testing.do_bench (median ms). Writes a JSON list to the path given as the first argument.
"""
import json, sys, torch, triton
from pagedllm.kernels.fused_moe import fused_moe, moe_tiles
from pagedllm.kernels.fused_moe_reference import fused_moe_ref

SHAPES = {"Mixtral-8x7B": (4096, 14336, 8, 2), "Qwen3-30B-A3B": (2048, 768, 128, 8)}
TOKENS = (1, 16, 64, 256, 2048)
generator = torch.Generator(device="cuda").manual_seed(0)
rows = []
for name, (hidden, inter, experts, top_k) in SHAPES.items():
    scale = hidden ** -0.5
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=generator) * scale).bfloat16()
    w_down = (torch.randn(experts, hidden, inter, device="cuda", generator=generator) * inter ** -0.5).bfloat16()
    for tokens in TOKENS:
        x = torch.randn(tokens, hidden, device="cuda", generator=generator).bfloat16()
        logits = torch.randn(tokens, experts, device="cuda", generator=generator)
        weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).bfloat16()
        fused = fused_moe(x, w_gate_up, w_down, weights, ids)
        loop = fused_moe_ref(x.float(), w_gate_up.float(), w_down.float(), weights.float(), ids)
        error = float((fused.float() - loop).abs().max() / loop.abs().max())
        fused_ms = triton.testing.do_bench(lambda: fused_moe(x, w_gate_up, w_down, weights, ids), rep=100)
        loop_ms = triton.testing.do_bench(lambda: fused_moe_ref(x, w_gate_up, w_down, weights, ids), rep=100)
        touched = int(torch.unique(ids).numel())
        # Bytes the step must read at least: the touched experts' weights.
        gbs = touched * 3 * hidden * inter * 2 / (fused_ms * 1e-3) / 1e9
        tiles = moe_tiles(tokens, top_k, experts)
        row = dict(model=name, tokens=tokens, experts_touched=touched, block_m=tiles.block_m, rel_error=error,
                   fused_ms=fused_ms, loop_ms=loop_ms, speedup=loop_ms / fused_ms, fused_weight_gbs=gbs)
        rows.append(row)
        print(f"{name:14} {tokens:5} tokens ({touched:3} experts, BLOCK_M {tiles.block_m:2}): fused {fused_ms:7.3f} ms, "
              f"per-expert loop {loop_ms:7.3f} ms, {loop_ms / fused_ms:5.2f}x, {gbs:6.0f} GB/s of expert weights, "
              f"rel. error {error:.1e}")
        if error > 3e-2:
            sys.exit(f"fused MoE differs from the per-expert loop by {error:.1e} (relative) at {name} x {tokens}")
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as handle:
        json.dump(rows, handle, indent=1)
