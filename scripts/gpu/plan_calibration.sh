#!/usr/bin/env bash
# `pagedllm plan` fitted on this GPU beside the H200 data-sheet figures. The step-time model comes from
# timed engine steps of a random-weight checkpoint with Llama-3.1-8B's layer shapes (16 of its 32 layers).
# Writes plan_calibration.json (the fitted step-time model) to OUT_DIR; the plans themselves are printed.
# Usage: bash scripts/gpu/plan_calibration.sh OUT_DIR
set -euo pipefail
out=$1
work=$(mktemp -d)
PLAN=(--model Llama-3.1-8B --gpu H200 --qps 8 --prompt-len 512 --output-len longtail:64-1024 --duration 60 --json)
pagedllm plan "${PLAN[@]}" --calibrate --cuda-graphs --calibration-layers 16 --save-calibration "$out/plan_calibration.json" \
    >"$work/plan_calibrated.json" 2>"$work/calibration.log" || { tail -20 "$work/calibration.log"; exit 1; }
tail -3 "$work/calibration.log"
pagedllm plan "${PLAN[@]}" >"$work/plan_datasheet.json"
python3 - "$out" "$work" <<'PY'
import json, sys
from pathlib import Path
out, work = Path(sys.argv[1]), Path(sys.argv[2])
model = json.loads((out / "plan_calibration.json").read_text())
measured = sorted(float(line.split("measured ")[1].split(" ms")[0])
                  for line in (work / "calibration.log").read_text().splitlines() if line.startswith("calibration step"))
print(f"{len(measured)} timed engine steps: median {measured[len(measured) // 2]:.2f} ms, max {measured[-1]:.2f} ms")
print(f"H200 data sheet x achievable share: {4800 * 0.8:.0f} GB/s, {989 * 0.6:.0f} TFLOP/s, 4 ms/step; calibrated: "
      f"{model['bandwidth_gbs'] or 0:.0f} GB/s, {model['tflops'] or 0:.0f} TFLOP/s, {1e3 * model['overhead_s']:.2f} ms/step")
for name in ("datasheet", "calibrated"):
    plan = json.loads((work / f"plan_{name}.json").read_text())
    print(f"{name}: predicted {plan['predicted_wall_s']:.1f} s, TTFT p99 {plan['ttft_p99']:.3f} s, "
          f"TPOT p99 {plan['tpot_p99']:.4f} s, {plan['steps']} steps")
PY
