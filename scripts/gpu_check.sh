#!/usr/bin/env bash
# Every GPU check in one call (for the lent H200 machine, which has torch, triton and
# transformers but no network). Installs pagedllm without dependencies, then runs the sections
# named on the command line (default: all, in this order), each under its own timeout:
#   engine   the engine on CUDA with the Triton kernels, CUDA graphs off and on, gives the CPU
#            backend's greedy tokens (fp32, llama, qwen3 and qwen2_moe); bf16 graphs on vs off
#   graphs   `pagedllm bench graphs`: decode tokens/s with CUDA graphs off and on (Llama-3.2-1B shapes)
#   launch   the planned Triton launch (plan once per step, every layer reuses it) against the
#            reference, and its host time per layer against an unplanned launch
#   kernels  `pagedllm bench kernels` (correctness, decode bandwidth vs peak, prefill TFLOP/s, SDPA)
#   plan     `pagedllm plan --calibrate` on this GPU beside the H200 data-sheet figures
#   tp       NCCL tensor parallelism: TP=2 against TP=1 greedy tokens, graphs off and on (needs 2 GPUs;
#            with one it says so and passes)
#   moe      the fused-MoE Triton kernel against a per-expert loop of torch GEMMs (Mixtral-8x7B and
#            Qwen3-30B-A3B layer shapes, bf16, 1-2048 tokens): correctness, then median ms of each
#   gpu      `pagedllm bench gpu` (issue 30): Llama-3.1-8B-shaped random bf16 checkpoint, graphs on:
#            continuous vs static tokens/s and ratio, KV waste, TTFT/TPOT at 16/64/256 QPS, decode
#            batch 1-256 vs the 4.8 TB/s roofline, the calibrated plan vs the measured runs (~5 min est.)
#   tiles    scripts/gpu/tune_attention_tiles_gpu.py: times candidate tiles/warps/stages per bf16
#            family and prints backend/kernels/attention_tiles.py entries to check in (then rerun `kernels`)
#   lora     multi-LoRA: the compiled shrink/expand kernels against their references (fp32, bf16, ranks 4-64),
#            their ms against a per-adapter torch loop at Llama-3.1-8B q|k|v shapes, and the CUDA engine's
#            tokens through three adapters (max_loras=2) against the CPU engine's
#   spec     speculative decoding (issue 41): n-gram and the embedded model's draft, graphs off and on, greedy
#            tokens with speculation against without, and ms per output token at batch 1 (scripts/gpu/spec_check.py)
#   fp8      FP8 KV cache kernels against their references (bytes written, attention read), the engine
#            with kv_cache_dtype=fp8_e4m3 against the CPU backend's tokens, FP8-weight Linears on
#            torch._scaled_mm (each scaling mode, and a decode step) against the dequantized path, and an
#            FP8 compressed-tensors checkpoint against transformers (skipped, saying so, where the
#            compressed-tensors package is not installed)
# The sections' programs are in scripts/gpu/. All together took 3.5 minutes on an H200 before `moe`
# and qwen2_moe were added (the timeouts now sum to 15.8: under a 10-minute limit, run `moe` and `fp8` on their
# own). Tables go to stdout, JSON results to $OUT (or ./gpu-results). Exit 1 if any section failed.
# The device allows 10 minutes per command and 15 per session, machine start included, so the default
# (every section) no longer fits: name the sections of each call. For issue 30, first call:
#   bash scripts/gpu_check.sh kernels gpu        (timeouts 110 + 450 s)
# then, in a later call or session: `tiles` (240 s; paste its table, commit, then `kernels` again),
# `engine graphs launch plan` (515 s), and `moe tp fp8` (420 s).
# Usage: bash scripts/gpu_check.sh [engine] [graphs] [launch] [kernels] [plan] [moe] [tp] [fp8] [lora] [spec] [gpu] [tiles]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SECTIONS=("$@")
[ ${#SECTIONS[@]} -eq 0 ] && SECTIONS=(engine graphs launch kernels plan moe tp fp8 lora spec gpu tiles)
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/tmp/pagedllm-install.log 2>&1 \
    || { cat /tmp/pagedllm-install.log; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__)"
FAILED=()

# section NAME SECONDS COMMAND...: runs COMMAND under a timeout; its output goes to the screen.
section() {
    local name=$1 seconds=$2; shift 2
    echo "=== $name (timeout ${seconds}s)"
    local start=$SECONDS
    timeout "$seconds" "$@" 2>&1
    local status=$?
    echo "=== $name: exit $status after $((SECONDS - start)) s"
    [ "$status" -eq 0 ] || FAILED+=("$name")
}

for name in "${SECTIONS[@]}"; do
    case $name in
        engine) section engine 170 python3 scripts/gpu/engine_cuda.py ;;
        graphs) section graphs 150 pagedllm bench graphs --json "$OUT/graphs.json" ;;
        launch) section launch 45 python3 scripts/gpu/planned_launch.py ;;
        kernels) section kernels 110 pagedllm bench kernels --rep-ms 30 --json "$OUT/kernels.json" ;;
        plan) section plan 150 bash scripts/gpu/plan_calibration.sh "$OUT" ;;
        moe) section moe 120 python3 scripts/gpu/fused_moe_bench.py "$OUT/fused_moe.json" ;;
        tp) section tp 90 python3 scripts/gpu/tp_nccl.py ;;
        fp8) section fp8 210 python3 scripts/gpu/fp8_check.py ;;
        lora) section lora 120 python3 scripts/gpu/lora_check.py ;;
        spec) section spec 150 python3 scripts/gpu/spec_check.py ;;
        gpu) section gpu 450 pagedllm bench gpu --json "$OUT/bench_gpu.json" ;;
        tiles) section tiles 240 python3 scripts/gpu/tune_attention_tiles_gpu.py --json "$OUT/attention_tiles.json" ;;
        *) echo "unknown section $name (engine, graphs, launch, kernels, plan, moe, tp, fp8, lora, spec, gpu, tiles)"
           FAILED+=("$name") ;;
    esac
done
echo "failed sections: ${FAILED[*]:-none}"
[ ${#FAILED[@]} -eq 0 ]
