#!/usr/bin/env bash
# GPU lab, round 2, in one device call (see docs/profiler.md): after the hot-path changes.
#   1. build the plugin (and, when .device-carry/hp_before holds the previous sources, that build too);
#   2. hot-path benchmark, 1/2/4/8 threads against the no-op plugin: previous and current code
#      alternating, three times, then the current code with CLOCK_MONOTONIC and with the writer idle;
#   3. 8-rank Kineto traces with an injected slow rank (scripts/gpu_lab_kineto.py), the plugin loaded
#      (the straggler scenario's raw logs come from the same run);
#   4. the real-NCCL proof and the step-time ratio (scripts/gpu_lab.py, rounds alternating);
#   5. make check (ASan+UBSan, TSan) on this machine.
# Each phase has its own timeout, and results are written to $OUT as each phase ends.
#   bash scripts/gpu_lab_round2.sh        (device: carry .device-carry/hp_before for the "before" build)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu_lab_round2}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exec > >(tee -a "$OUT/round2.log") 2>&1
T0=$(date +%s)
phase() { echo "=== $1 (t+$(($(date +%s) - T0)) s)"; }

phase machine
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
echo "cpus: $(nproc)"; lscpu | grep -E "^(Model name|Socket|Core|Thread|NUMA node\(s\)|Hypervisor)" || true
python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())" || true

phase build
P=native/profiler/build
make -C native/profiler clean all build/libnccl-profiler-noop.so build/profiler_hotpath >"$OUT/build.tmp" 2>&1 \
  || { cat "$OUT/build.tmp"; exit 1; }
rm -f "$OUT/build.tmp"
BEFORE=""
if [ -d .device-carry/hp_before/src ]; then
  make -C .device-carry/hp_before build/libnccl-profiler-comminsight.so >/dev/null 2>&1 \
    && BEFORE=.device-carry/hp_before/build/libnccl-profiler-comminsight.so
fi
PLUGIN="$PWD/$P/libnccl-profiler-comminsight.so"

phase "hot-path bench"
bench() { "$P/profiler_hotpath" "$1" "$P/libnccl-profiler-noop.so" "${@:2}"; }
timeout 150 bash -c "$(declare -f bench); P=$P
  for rep in 1 2 3; do
    if [ -n '$BEFORE' ]; then echo \"## before, rep \$rep\"; bench $BEFORE; fi
    echo \"## after, rep \$rep\"; bench $PLUGIN
  done
  echo '## after, COMMINSIGHT_CLOCK=monotonic'; COMMINSIGHT_CLOCK=monotonic bench $PLUGIN | tail -6
  echo '## after, writer idle during the runs'; COMMINSIGHT_WRITER_INTERVAL_MS=10000 bench $PLUGIN 20 500 | tail -6
  if [ -n '$BEFORE' ]; then echo '## before, writer idle'; COMMINSIGHT_WRITER_INTERVAL_MS=10000 bench $BEFORE 20 500 | tail -6; fi
" | tee "$OUT/native.txt"

phase "kineto traces + straggler (plugin loaded)"
timeout 200 python3 scripts/gpu_lab_kineto.py --plugin "$PLUGIN" --out "$OUT" --timeout 180 | tail -30

phase "real-NCCL proof and step-time ratio"
timeout 280 python3 scripts/gpu_lab.py --plugin "$PLUGIN" --out "$OUT" --rounds 3 --steps 25 --warmup 5 \
  --phase-timeout 70 | tail -45

phase "make check"
timeout 120 make -C native/profiler check 2>&1 | grep -E "^ok|FAIL|passed|Sanitizer|Error" | tail -30 \
  | tee -a "$OUT/native.txt"
phase done
