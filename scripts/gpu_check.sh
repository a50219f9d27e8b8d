#!/usr/bin/env bash
# Every GPU check in one call (for the lent H200 machine, which has torch, triton and
# transformers but no network): installs pagedllm without dependencies, then
#   1. the engine on CUDA with the Triton kernels gives the CPU reference's greedy tokens,
#   2. `pagedllm bench kernels` (correctness, decode bandwidth vs peak, prefill TFLOP/s, SDPA baseline).
# Results go to $OUT (or ./gpu-results). Usage: bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 \
    || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"

python3 - <<'PY' 2>&1 | tee "$OUT/engine_cuda.txt"
import tempfile, torch
from pathlib import Path
from pagedllm import LLM, SamplingParams
from pagedllm.testing.tiny_model import make_tiny_model

params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
prompts = [{"prompt_token_ids": torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
           for n in (5, 40, 130, 300)]
for arch in ("llama", "qwen3"):
    model = make_tiny_model(Path(tempfile.mkdtemp()) / arch, arch=arch)
    cpu = LLM(model=str(model), dtype="float32", device="cpu")
    cuda = LLM(model=str(model), dtype="float32", device="cuda", attention_backend="triton")
    want = [o.outputs[0].token_ids for o in cpu.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in cuda.generate(prompts, params)]
    same = sum(a == b for a, b in zip(want, got))
    print(f"{arch}: {same}/{len(prompts)} prompts give identical greedy tokens on CUDA+Triton vs CPU reference")
    bf16 = LLM(model=str(model), dtype="bfloat16", device="cuda")
    print(f"{arch}: bfloat16 on CUDA ran, stats {bf16.generate(prompts, params) and bf16.stats()}")
PY

timeout 420 pagedllm bench kernels --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.md"
