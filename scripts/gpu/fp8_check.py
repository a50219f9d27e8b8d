"""FP8 on CUDA: the KV kernels against their references, the engine with an FP8 KV cache against the CPU
backend's tokens, FP8-weight Linears on torch._scaled_mm against the dequantized path, and a compressed-tensors
FP8 checkpoint against transformers.

1. write_kv into e4m3/e5m2 caches gives the reference's bytes (saturation included); unified attention over
   them matches the reference (fp32 and bf16 queries, mixed prefill+decode, GQA, block sizes 16 and 32).
2. The engine (triton backend, fp32, graphs off and on) with kv_cache_dtype=fp8_e4m3 gives the CPU backend's
   greedy tokens with the same cache dtype: the same bytes are written, so the same tokens should follow.
3. FP8 weights on FP8 tensor cores (scripts/gpu/fp8_weights.py): Fp8Linear's torch._scaled_mm in each scaling
   mode against a quantize-dequantize reference, and a decode step of the embedded model with e4m3 decoder Linears
   (fp32 and bf16) against the dequantized path that rounds inputs the same way. Skipped below capability 8.9.
4. A compressed-tensors FP8 checkpoint (per-channel dynamic, per-tensor static): dequantized once, it decodes
   transformers' greedy tokens (input rounding off); on _scaled_mm it follows transformers rounding inputs to
   FP8 (teacher-forced top-1 >= 85% on this random model, and closer than the dequantized path), and runs with
   CUDA graphs. Needs the compressed-tensors package: without it this part says so and is skipped.
"""
import sys
import tempfile
from pathlib import Path

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.kernels import unified_attention, write_kv
from pagedllm.kernels.reference import FP8_DTYPES, quantize_kv_ref, unified_attention_ref, write_kv_ref
from pagedllm.layers.fp8_linear import fp8_tensor_cores
from pagedllm.testing.paged_batch import random_paged_batch
from pagedllm.testing.tiny_model import make_tiny_model

from fp8_weights import checkpoint_against_transformers, scaled_mm_decode_step, scaled_mm_modes

failures = 0
cuda = torch.device("cuda")

# 1. kernels
for dtype in FP8_DTYPES:
    key = torch.randn(64, 2, 128, device=cuda) * 50
    key[0, 0, :4] = torch.tensor([1e9, -1e9, float("inf"), 3e-9])
    value = torch.randn(64, 2, 128, device=cuda)
    slots = torch.randperm(256, device=cuda)[:64]
    shape = (16, 16, 2, 128)
    caches = [torch.zeros(shape, dtype=dtype, device=cuda) for _ in range(4)]
    scale_k, scale_v = torch.tensor([0.05], device=cuda), torch.tensor([0.01], device=cuda)
    write_kv(key, value, caches[0], caches[1], slots, scale_k, scale_v)
    write_kv_ref(key, value, caches[2], caches[3], slots, scale_k, scale_v)
    same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in ((caches[0], caches[2]),
                                                                                  (caches[1], caches[3])))
    failures += not same
    print(f"write_kv {dtype}: {'same bytes as the reference' if same else 'DIFFERENT bytes'}")
    for q_dtype in (torch.float32, torch.bfloat16):
        for block_size in (16, 32):
            batch = random_paged_batch((7, 1, 1, 33), (40, 90, 300, 33), 32, 8, 128, block_size, q_dtype, cuda,
                                       torch.Generator(device=cuda).manual_seed(block_size), spare_columns=1)
            k8, v8 = quantize_kv_ref(batch.k_cache, scale_k, dtype), quantize_kv_ref(batch.v_cache, scale_v, dtype)
            layout = (batch.query_start_loc, batch.seq_lens, batch.block_table, batch.scale)
            want = unified_attention_ref(batch.q, k8, v8, *layout, k_scale=scale_k, v_scale=scale_v)
            got = unified_attention(batch.q, k8, v8, *layout, k_scale=scale_k, v_scale=scale_v)
            error = float((got.float() - want.float()).abs().max())
            bound = 1e-4 if q_dtype == torch.float32 else 3e-2
            failures += not error <= bound
            print(f"unified_attention {dtype} q={q_dtype} block {block_size}: max error {error:.1e} (bound {bound})")

# 2. the engine with an FP8 KV cache
lengths = (5, 40, 130, 300, 17, 64, 3, 90)
prompts = [{"prompt_token_ids": torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
           for n in lengths]
params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "llama", arch="llama"))


def tokens(llm: LLM, which: list) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(which, params)]


want = tokens(LLM(model=model, dtype="float32", device="cpu", kv_cache_dtype="fp8_e4m3"), prompts)
for label, extra in (("graphs off", {}), ("graphs on", {"cuda_graphs": True, "max_num_seqs": 16})):
    llm = LLM(model=model, dtype="float32", device="cuda", attention_backend="triton", kv_cache_dtype="fp8_e4m3",
              **extra)
    same = sum(a == b for a, b in zip(want, tokens(llm, prompts)))
    failures += same != len(prompts)
    print(f"engine fp8_e4m3 KV, fp32, {label}: {same}/{len(prompts)} prompts give the CPU backend's tokens; "
          f"{llm.stats().num_blocks_total} blocks")

# 3. FP8 weights on FP8 tensor cores (compute capability 8.9+): torch._scaled_mm against the dequantized path
if not fp8_tensor_cores(cuda):
    print(f"fp8 weights: _scaled_mm SKIPPED, compute capability {torch.cuda.get_device_capability()} < 8.9")
else:
    failures += scaled_mm_modes(cuda)
    failures += scaled_mm_decode_step(cuda, ("float32", "bfloat16"))

# 4. a compressed-tensors FP8 checkpoint against transformers
try:
    import compressed_tensors  # noqa: F401
except ImportError:
    print("fp8 checkpoints: SKIPPED, the compressed-tensors package is not installed on this machine")
else:
    failures += checkpoint_against_transformers(model, Path(tempfile.mkdtemp()), cuda)
sys.exit(1 if failures else 0)
