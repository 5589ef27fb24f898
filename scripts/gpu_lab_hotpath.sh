#!/usr/bin/env bash
# Hot path on the GPU host in one device call (docs/profiler.md, "The hot-path benchmark"):
#   1. build this checkout's plugin and, when BEFORE_SRC holds an earlier native/profiler, that build too;
#   2. `profiler_hotpath` for 1/2/4/8 threads against the no-op plugin, before and after alternating,
#      HOT_ROUNDS times (default ROUNDS, 5), so both see the same neighbours;
#   3. the 8-rank lab job's step time without and with the plugin, alternating ROUNDS times
#      (scripts/gpu_lab.py), with its spread;
#   4. make check (ASan+UBSan, TSan) on that machine;
#   with VARIANTS=1, between 2 and 3: the same benchmark under changed conditions, to see what the figure is
#   made of: the coarse clock instead of rdtsc for before and after (what the two timestamps cost), the writer
#   idle during the runs (it wakes every 10 s; 20 batches so the pool holds every operation), slots
#   prefetched 2 ahead and not at all instead of CI_PREFETCH_AHEAD;
#   LAB=0 leaves out phase 3, CHECK=0 phase 4.
# Every phase has its own timeout; results land in $OUT as each phase ends.
#   OUT=/tmp/hp BEFORE_SRC=/path/to/old/native/profiler bash scripts/gpu_lab_hotpath.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu_lab_hotpath}
ROUNDS=${ROUNDS:-5}
HOT_ROUNDS=${HOT_ROUNDS:-$ROUNDS}
# phase limits, so one call fits a device-time budget: the lab job's steps and timeout, make check's timeout
LAB_STEPS=${LAB_STEPS:-20} LAB_WARMUP=${LAB_WARMUP:-5} LAB_TIMEOUT=${LAB_TIMEOUT:-240} CHECK_TIMEOUT=${CHECK_TIMEOUT:-90}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exec > >(tee -a "$OUT/hotpath.log") 2>&1
T0=$(date +%s)
phase() { echo "=== $1 (t+$(($(date +%s) - T0)) s)"; }

phase machine
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
echo "cpus: $(nproc)"; lscpu | grep -E "^(Model name|Hypervisor)" || true

phase build
P=native/profiler/build
make -C native/profiler clean all build/libnccl-profiler-noop.so build/profiler_hotpath >"$OUT/build.tmp" 2>&1 \
  || { cat "$OUT/build.tmp"; exit 1; }
BEFORE=""
if [ -n "${BEFORE_SRC:-}" ] && [ -d "$BEFORE_SRC/src" ]; then
  make -C "$BEFORE_SRC" build/libnccl-profiler-comminsight.so >/dev/null 2>&1 \
    && BEFORE=$BEFORE_SRC/build/libnccl-profiler-comminsight.so
fi
PLUGIN="$PWD/$P/libnccl-profiler-comminsight.so"

phase "hot-path bench, $HOT_ROUNDS rounds"
for rep in $(seq 1 "$HOT_ROUNDS"); do
  if [ -n "$BEFORE" ]; then echo "## before, round $rep"; timeout 30 "$P/profiler_hotpath" "$BEFORE" "$P/libnccl-profiler-noop.so" | tail -5; fi
  echo "## after, round $rep"; timeout 30 "$P/profiler_hotpath" "$PLUGIN" "$P/libnccl-profiler-noop.so" | tail -5
done | tee "$OUT/native.txt"
"$P/profiler_hotpath" "$PLUGIN" "$P/libnccl-profiler-noop.so" 2>&1 | head -1 | tee -a "$OUT/native.txt"

if [ "${VARIANTS:-0}" = 1 ]; then
  phase "hot-path variants (what the figure is made of)"
  for ahead in 0 2; do
    (cd native/profiler && cc -std=c11 -D_GNU_SOURCE -O2 -fPIC -pthread -fvisibility=hidden -Iinclude -Isrc \
      -DCI_PREFETCH_AHEAD=$ahead -shared -o build/variant-ahead$ahead.so src/*.c)
  done
  NOOP="$P/libnccl-profiler-noop.so"
  for rep in 1 2; do
    echo "## after, round $rep"; timeout 30 "$P/profiler_hotpath" "$PLUGIN" "$NOOP" | tail -4
    echo "## after, coarse clock, round $rep"; COMMINSIGHT_CLOCK=coarse timeout 30 "$P/profiler_hotpath" "$PLUGIN" "$NOOP" | tail -4
    if [ -n "$BEFORE" ]; then echo "## before, coarse clock, round $rep"
      COMMINSIGHT_CLOCK=coarse timeout 30 "$P/profiler_hotpath" "$BEFORE" "$NOOP" | tail -4; fi
    echo "## after, writer idle, round $rep"
    COMMINSIGHT_WRITER_INTERVAL_MS=10000 timeout 60 "$P/profiler_hotpath" "$PLUGIN" "$NOOP" 20 500 | tail -4
    if [ -n "$BEFORE" ]; then echo "## before, writer idle, round $rep"
      COMMINSIGHT_WRITER_INTERVAL_MS=10000 timeout 60 "$P/profiler_hotpath" "$BEFORE" "$NOOP" 20 500 | tail -4; fi
    echo "## after, no prefetch, round $rep"; timeout 30 "$P/profiler_hotpath" "$P/variant-ahead0.so" "$NOOP" | tail -4
    echo "## after, prefetch 2 ahead, round $rep"; timeout 30 "$P/profiler_hotpath" "$P/variant-ahead2.so" "$NOOP" | tail -4
  done | tee "$OUT/variants.txt"
fi

if [ "${LAB:-1}" = 1 ]; then
phase "step time without/with the plugin, $ROUNDS rounds"
timeout "$LAB_TIMEOUT" python3 scripts/gpu_lab.py --plugin "$PLUGIN" --out "$OUT" --rounds "$ROUNDS" \
  --steps "$LAB_STEPS" --warmup "$LAB_WARMUP" --phase-timeout 40 | tail -25
fi

if [ "${CHECK:-1}" = 1 ]; then
phase "make check"
timeout "$CHECK_TIMEOUT" make -C native/profiler check 2>&1 | grep -E "^ok|FAIL|passed|Sanitizer|Error" | tail -24 | tee -a "$OUT/native.txt"
fi
phase done
