#!/usr/bin/env bash
# GPU lab for issue 15 (live diagnosis, device counters) in one device call:
#   1. build the profiler plugin (with the ring header's agent requests);
#   2. scripts/gpu_lab_live.py: NVML samples through the agent's GpuSampler while a real 4-rank NCCL job
#      runs on cuda:0 (shared/docs/GPU_LAB.md); the last rank stalls outside NCCL; live hang detection
#      and root-cause latency with the real agent when its dependencies import there, else the
#      profiler's in-flight reports timed by a stand-in consumer; the home comes back as home.tar.gz.
# The device has no internet and only PyTorch's environment (Python 3.12, numpy, pyarrow, httpx, typer,
# rich, prometheus_client seen there): nvidia-ml-py and the agent's other dependencies travel as wheels in
# .device-carry/live/wheels (about 45 MB) and are installed into a private directory.
# Recipe, from the repository root here:
#   rm -rf .device-carry/live && mkdir -p .device-carry/live && git archive HEAD | tar -x -C .device-carry/live
#   .venv/bin/pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_17_x86_64 --no-deps -d .device-carry/live/wheels \
#     nvidia-ml-py==13.615.71 polars==1.33.1 cffi==2.0.0 pycparser==2.23 zstandard==0.25.0 orjson==3.13.0
#   device run, carry [".device-carry/live"]: cd .device-carry/live && bash scripts/gpu_lab_live.sh
# Results in $OUT (else bench/results/gpu_lab_live).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu_lab_live}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())" || true
make -C native/profiler >"$OUT/build.log" 2>&1 || { cat "$OUT/build.log"; exit 1; }
if ls wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index --target /tmp/ci-live-deps wheels/*.whl >>"$OUT/build.log" 2>&1 \
    && export PYTHONPATH=/tmp/ci-live-deps${PYTHONPATH:+:$PYTHONPATH}
fi
python3 scripts/gpu_lab_live.py --plugin "$PWD/native/profiler/build/libnccl-profiler-comminsight.so" \
  --out "$OUT" "$@"
