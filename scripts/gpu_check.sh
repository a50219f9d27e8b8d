#!/usr/bin/env bash
# Every GPU check in one call (for the lent H200 machine, which has torch, triton and
# transformers but no network): installs pagedllm without dependencies, then
#   1. the engine on CUDA with the Triton kernels gives the CPU reference's greedy tokens,
#   1b. the planned Triton launch (plan once per step, every layer reuses it) against the
#       reference, and its host time per layer against an unplanned launch,
#   2. `pagedllm bench kernels` (correctness, decode bandwidth vs peak, prefill TFLOP/s, SDPA baseline),
#   3. `pagedllm plan --calibrate`: the step-time model fitted on this GPU beside the H200 data-sheet figures.
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
    print(f"{arch}: {same}/{len(prompts)} prompts give identical greedy tokens on CUDA+Triton (planned launch) "
          "vs the CPU torch backend")
    bf16 = LLM(model=str(model), dtype="bfloat16", device="cuda")
    print(f"{arch}: bfloat16 on CUDA ran, stats {bf16.generate(prompts, params) and bf16.stats()}")
PY

python3 - <<'PY' 2>&1 | tee "$OUT/planned_launch.txt"
import time, torch
from pagedllm.kernels import unified_attention_ref
from pagedllm.kernels.attention_launch import plan_unified_attention, unified_attention, unified_attention_planned
from pagedllm.testing.paged_batch import random_paged_batch

generator = torch.Generator(device="cuda").manual_seed(0)
layouts = {"decode 64 x ctx 2k": ([1] * 64, [2048] * 64), "decode 2 x ctx 16k (split-KV)": ([1, 1], [16384, 9000]),
           "mixed": ([1, 1, 300, 1], [700, 2500, 1536, 40])}
for name, (query_lens, seq_lens) in layouts.items():
    for dtype in (torch.bfloat16, torch.float32):
        batch = random_paged_batch(query_lens, seq_lens, 32, 8, 128, 16, dtype, "cuda", generator, spare_columns=1)
        step = plan_unified_attention(batch.query_start_loc, batch.seq_lens, batch.block_table)
        errors = []
        for _ in range(4):  # four "layers": new queries and cache contents, one plan
            q, k, v = (torch.randn_like(t) for t in (batch.q, batch.k_cache, batch.v_cache))
            out = unified_attention_planned(q, k, v, step, batch.scale)
            ref = unified_attention_ref(q, k, v, *batch.args()[3:])
            errors.append(float((out.float() - ref.float()).abs().max()))
        (launch,) = step.launches.values()
        def host_us(fn, reps=50):
            torch.cuda.synchronize(); start = time.perf_counter()
            for _ in range(reps): fn()
            elapsed = time.perf_counter() - start; torch.cuda.synchronize()
            return elapsed / reps * 1e6
        planned = host_us(lambda: unified_attention_planned(batch.q, batch.k_cache, batch.v_cache, step, batch.scale))
        unplanned = host_us(lambda: unified_attention(*batch.args()))
        print(f"{name} {str(dtype).removeprefix('torch.')}: max error over 4 layers {max(errors):.2e}, "
              f"splits {launch.tiles.num_splits}, launch plans {len(step.launches)}, "
              f"enqueue per layer planned {planned:.0f} us vs unplanned {unplanned:.0f} us")
PY

timeout 420 pagedllm bench kernels --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.md"

# 3. Planner calibration: timed engine steps of a random-weight checkpoint with Llama-3.1-8B's layer shapes
#    (16 of its 32 layers) give this GPU's effective bandwidth, TFLOP/s and per-step overhead; the same plan is
#    then made from the catalog's H200 figures, so the two predictions sit side by side.
PLAN=(--model Llama-3.1-8B --gpu H200 --qps 8 --prompt-len 512 --output-len longtail:64-1024 --duration 60 --json)
timeout 300 pagedllm plan "${PLAN[@]}" --calibrate --calibration-layers 16 --save-calibration "$OUT/plan_calibration.json" \
    >"$OUT/plan_calibrated.json" 2>"$OUT/plan_calibration.log"; tail -1 "$OUT/plan_calibration.log"
timeout 120 pagedllm plan "${PLAN[@]}" >"$OUT/plan_datasheet.json"
python3 - "$OUT" <<'PY' 2>&1 | tee "$OUT/plan_check.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
model = json.loads((out / "plan_calibration.json").read_text())
print(f"H200 data sheet x achievable share: {4800 * 0.8:.0f} GB/s, {989 * 0.6:.0f} TFLOP/s, 4 ms/step; calibrated: "
      f"{model['bandwidth_gbs'] or 0:.0f} GB/s, {model['tflops'] or 0:.0f} TFLOP/s, {1e3 * model['overhead_s']:.2f} ms/step")
for name in ("datasheet", "calibrated"):
    plan = json.loads((out / f"plan_{name}.json").read_text())
    print(f"{name}: predicted {plan['predicted_wall_s']:.1f} s, TTFT p99 {plan['ttft_p99']:.3f} s, "
          f"TPOT p99 {plan['tpot_p99']:.4f} s, {plan['steps']} steps")
PY
