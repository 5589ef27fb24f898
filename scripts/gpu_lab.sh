#!/usr/bin/env bash
# The GPU lab in one call (see docs/profiler.md): build the plugin, run its C checks and the hot-path
# benchmark, then scripts/gpu_lab.py (8 NCCL ranks on one GPU, with and without the plugin).
# Results go to $OUT (the device tool's folder) or bench/results/gpu_lab.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu_lab}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
make -C native/profiler clean all >"$OUT/build.log" 2>&1 || { cat "$OUT/build.log"; exit 1; }
BENCH="./native/profiler/build/profiler_hotpath native/profiler/build/libnccl-profiler-comminsight.so native/profiler/build/libnccl-profiler-noop.so"
{
  make -C native/profiler check 2>&1 | grep -E "^ok|FAIL|passed|Sanitizer" | tail -25
  make -C native/profiler bench 2>&1
  for clock in tsc monotonic; do COMMINSIGHT_CLOCK=$clock $BENCH | tail -5; done
  # diagnostic: the writer never drains during the runs (no cache lines shared with it)
  echo "writer idle during the runs:"; COMMINSIGHT_WRITER_INTERVAL_MS=10000 $BENCH 20 500 | tail -5
} | tee "$OUT/native.txt"
python3 scripts/gpu_lab.py --plugin "$PWD/native/profiler/build/libnccl-profiler-comminsight.so" --out "$OUT" "$@"
