"""The engine on CUDA with the Triton kernels, CUDA graphs off and on, against the CPU backend's greedy tokens."""
import sys, tempfile, torch
from pathlib import Path
from pagedllm import LLM, SamplingParams
from pagedllm.testing.tiny_model import make_tiny_model

# Different lengths and output budgets, so decode batches shrink through several captured sizes.
lengths = (5, 40, 130, 300, 17, 64, 3, 90, 200, 33, 9)
prompts = [{"prompt_token_ids": torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
           for n in lengths]
params = [SamplingParams(max_tokens=8 + 4 * i, temperature=0.0, ignore_eos=True) for i in range(len(lengths))]
failures = 0

def tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]

for arch in ("llama", "qwen3", "qwen2_moe"):  # qwen2_moe: the fused-MoE kernel inside the engine, graphs included
    model = str(make_tiny_model(Path(tempfile.mkdtemp()) / arch, arch=arch))
    want = tokens(LLM(model=model, dtype="float32", device="cpu"))
    for label, extra in (("graphs off", {}), ("graphs on", {"cuda_graphs": True, "max_num_seqs": 16})):
        llm = LLM(model=model, dtype="float32", device="cuda", attention_backend="triton", **extra)
        got = tokens(llm)
        same = sum(a == b for a, b in zip(want, got))
        failures += same != len(prompts)
        captured = llm.engine.runner.graphs.sizes if llm.engine.runner.graphs else ()
        print(f"{arch} fp32 {label} (captured sizes {captured}): {same}/{len(prompts)} prompts give the CPU "
              "backend's greedy tokens")
    bf16 = [tokens(LLM(model=model, dtype="bfloat16", device="cuda", **extra))
            for extra in ({}, {"cuda_graphs": True, "max_num_seqs": 16})]
    same = sum(a == b for a, b in zip(*bf16))
    print(f"{arch} bf16: graphs on and off agree on {same}/{len(prompts)} prompts")
sys.exit(1 if failures else 0)
