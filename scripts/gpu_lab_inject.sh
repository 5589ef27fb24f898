#!/usr/bin/env bash
# GPU lab for the import hook (docs/torch-hook.md), one device call, per shared/docs/GPU_LAB.md:
#   1. build the profiler plugin;
#   2. `python3 -m comminsight_inject install` into the machine's PyTorch environment (the same installer
#      as `comminsight inject install`; the device has no project virtualenv), then `status`;
#   3. an unmodified 8-rank TP2 x DP2 x PP2 job (scripts/inject_job.py, NCCL, all ranks on cuda:0) with
#      the plugin loaded; rank 5 skips its data-parallel all-reduce at step 10 (an injected hang) and
#      PyTorch's watchdog ends the job;
#   4. uninstall; the home (raw logs, hang evidence, process-group tables) comes back as home.tar.gz.
# Then, here: `comminsight analyze hang HOME` names the stuck groups (see docs/torch-hook.md).
#   bash scripts/gpu_lab_inject.sh     (results in $OUT, else bench/results/gpu_lab_inject)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu_lab_inject}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exec > >(tee -a "$OUT/lab.log") 2>&1
T0=$(date +%s)
phase() { echo "=== $1 (t+$(($(date +%s) - T0)) s)"; }

phase machine
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())" || true

phase build
make -C native/profiler >/dev/null 2>&1 || { make -C native/profiler; exit 1; }
PLUGIN="$PWD/native/profiler/build/libnccl-profiler-comminsight.so"

phase "install the hook"
PYTHONPATH=inject python3 -m comminsight_inject install || exit 1
PYTHONPATH=inject python3 -m comminsight_inject status | tee "$OUT/status.txt"

phase "8-rank job with an injected hang"
HOME_DIR=/tmp/ci-inject-home
rm -rf "$HOME_DIR" && mkdir -p "$HOME_DIR"
# the job sees nothing of this repository: no PYTHONPATH, no wrapper, the script runs as is
( cd /tmp && env -u PYTHONPATH COMMINSIGHT_HOME="$HOME_DIR" NCCL_PROFILER_PLUGIN="$PLUGIN" \
    COMMINSIGHT_HANG_TIMEOUT_S=5 COMMINSIGHT_AGENT_AUTOSTART=0 COMMINSIGHT_LOG_SEGMENT_AGE_S=10 \
    timeout -k 10 200 python3 -m torch.distributed.run --nproc-per-node 8 --master-port 29611 \
    "$OLDPWD/scripts/inject_job.py" --backend nccl --gpu-lab --tp 2 --pp 2 --steps 30 \
    --hang-rank 5 --hang-step 10 --timeout-s 45 ) > "$OUT/job.log" 2>&1
echo "job exit status $? (non-zero expected: the watchdog ends the hung job)"
grep -E "step [0-9]+ done|injected hang|TRAINING-OK" "$OUT/job.log" | head -20
grep -ciE "watchdog|timeout|timed out" "$OUT/job.log" | sed 's/^/watchdog\/timeout lines: /'
ls -la "$HOME_DIR" "$HOME_DIR/metadata" "$HOME_DIR/inspector_logs" "$HOME_DIR/hang_detection" 2>&1 | head -60
python3 - "$HOME_DIR" <<'PY'
import json, sys, pathlib
for path in sorted(pathlib.Path(sys.argv[1], "metadata").glob("process_groups-*.json")):
    table = json.loads(path.read_text())
    print(path.name, "rank", table["rank"], "level", table["level"], [(g["desc"], g["ranks"]) for g in table["groups"]])
PY

phase uninstall
PYTHONPATH=inject python3 -m comminsight_inject uninstall
tar -czf "$OUT/home.tar.gz" -C "$HOME_DIR" --exclude=shms .
ls -la "$OUT"
phase done
