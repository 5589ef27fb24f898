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
{ make -C native/profiler check 2>&1 | tail -25; make -C native/profiler bench 2>&1; } | tee "$OUT/native.txt"
python3 scripts/gpu_lab.py --plugin "$PWD/native/profiler/build/libnccl-profiler-comminsight.so" --out "$OUT" "$@"
