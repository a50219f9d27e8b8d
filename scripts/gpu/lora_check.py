"""Multi-LoRA on CUDA: the compiled shrink/expand kernels against their references, their speed against a
per-adapter loop of torch GEMMs, and the engine's tokens through adapters against the CPU engine's.

1. lora_shrink / lora_expand (fp32 and bf16; ranks 4-64; random segments with base-only tokens and an idle slot)
   match lora_shrink_ref / lora_expand_ref.
2. Median ms at Llama-3.1-8B's q|k|v shapes (4096 -> 6144, rank 16 x 3 parts, bf16), 16 adapters over 1-2048
   tokens: the two kernels against one pair of torch matmuls per adapter group (the CPU path's shape).
3. The engine on CUDA (triton backend, fp32, cuda_graphs off: LoRA refuses graphs) with three adapters mixed with
   base-only requests and max_loras=2 (swaps) gives the CPU engine's greedy tokens.
"""
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.kernels.lora_reference import lora_expand_ref, lora_shrink_ref
from pagedllm.kernels.lora_sgmv import lora_expand, lora_shrink
from pagedllm.lora.mapping import build_lora_mapping
from pagedllm.testing.lora_adapters import make_random_adapter
from pagedllm.testing.tiny_model import make_tiny_model

failures = 0
cuda = torch.device("cuda")
rng = np.random.default_rng(0)


def mapping_for(num_seqs: int, max_len: int, slots: int):
    query_lens = rng.integers(1, max_len + 1, num_seqs)
    seq_slots = rng.integers(-1, slots - 1, num_seqs)  # the last slot is idle; -1 is the base model
    return build_lora_mapping(seq_slots, query_lens, cuda), int(query_lens.sum())


# 1. correctness
for dtype in (torch.float32, torch.bfloat16):
    for rank, k, n in ((4, 4096, 1024), (16, 2048, 6144), (64, 1000, 333)):
        mapping, tokens = mapping_for(24, 40, 5)
        segments = (mapping.token_indices, mapping.seg_starts, mapping.seg_slots, mapping.max_seg_len)
        x = torch.randn(tokens, k, device=cuda, dtype=dtype)
        a = (torch.randn(5, rank, k, device=cuda) / k**0.5).to(dtype)
        b = torch.randn(5, n, rank, device=cuda).to(dtype)
        got, want = torch.zeros(tokens, rank, device=cuda), torch.zeros(tokens, rank, device=cuda)
        lora_shrink(x, a, got, *segments)
        lora_shrink_ref(x, a, want, *segments)
        y = torch.randn(tokens, n, device=cuda, dtype=dtype)
        y_got, y_want = y.clone(), y.clone()
        lora_expand(want, b, y_got, *segments)
        lora_expand_ref(want, b, y_want, *segments)
        bound = 1e-3 if dtype == torch.float32 else 5e-2
        shrink_error = float((got - want).abs().max())
        expand_error = float((y_got.float() - y_want.float()).abs().max() / y_want.float().abs().max())
        ok = shrink_error <= bound and expand_error <= bound
        failures += not ok
        print(f"{dtype} rank {rank} {k}->{n}: shrink max error {shrink_error:.1e}, expand relative {expand_error:.1e}"
              f" {'ok' if ok else 'FAILED'}")


# 2. speed
def median_ms(fn, reps: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


print("| tokens | kernels ms | torch loop ms |\n|---|---|---|")
a = (torch.randn(17, 48, 4096, device=cuda) / 64).bfloat16()
b = torch.randn(17, 6144, 48, device=cuda).bfloat16()
for num_seqs, max_len in ((1, 1), (16, 1), (64, 1), (256, 1), (16, 128)):
    mapping, tokens = mapping_for(num_seqs, max_len, 17)
    segments = (mapping.token_indices, mapping.seg_starts, mapping.seg_slots, mapping.max_seg_len)
    x = torch.randn(tokens, 4096, device=cuda).bfloat16()
    y = torch.zeros(tokens, 6144, device=cuda).bfloat16()
    buffer = torch.empty(tokens, 48, device=cuda)

    def kernels() -> None:
        lora_shrink(x, a, buffer, *segments)
        lora_expand(buffer, b, y, *segments)

    order = mapping.token_indices.long()

    def loop() -> None:
        for span in mapping.spans:
            rows = order[span.start : span.stop]
            y[rows] += (x[rows] @ a[span.slot].T) @ b[span.slot].T

    print(f"| {tokens} | {median_ms(kernels):.3f} | {median_ms(loop):.3f} |")

# 3. the engine
base = make_tiny_model(Path(tempfile.mkdtemp()) / "llama", arch="llama")
adapters = [LoRARequest(f"a{i}", i + 1, str(make_random_adapter(base, base.parent / f"a{i}", rank, 16, seed=i, std=0.2)))
            for i, rank in enumerate((8, 16, 4))]
prompts = [{"prompt_token_ids": torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
           for n in (5, 40, 130, 300, 17, 64, 3, 90)]
loras = [adapters[i % 3] if i % 4 != 3 else None for i in range(len(prompts))]
params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
outputs = {}
for device in ("cuda", "cpu"):
    llm = LLM(str(base), dtype="float32", device=device, enable_lora=True, max_loras=2, max_lora_rank=16,
              num_kv_blocks=256, **({"attention_backend": "triton"} if device == "cuda" else {}))
    outputs[device] = [out.outputs[0].token_ids for out in llm.generate(prompts, params, lora_request=loras)]
    if device == "cuda":
        print(f"cuda engine: {llm.engine.lora.slots.num_evictions} slot evictions")
same = sum(a == b for a, b in zip(outputs["cuda"], outputs["cpu"]))
print(f"engine: {same}/{len(prompts)} requests give the CPU engine's tokens")
failures += same < len(prompts) - 1  # one exact top-two tie may flip between backends
sys.exit(1 if failures else 0)
