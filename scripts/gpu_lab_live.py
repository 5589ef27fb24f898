"""GPU lab for live diagnosis and device counters (issue 15), run on the device machine in one call.

1. NVML through the agent's own GPU sampler (``comminsight.agent.samplers.GpuSampler`` with the real
   ``pynvml`` from the carried nvidia-ml-py wheel): samples while a real NCCL job runs on the GPU.
2. Live hang detection on real NCCL: 4 ranks on ``cuda:0`` (scripts/gpu_lab.py's DDP worker, per
   shared/docs/GPU_LAB.md), the last rank stalls outside NCCL before step ``--hang-step`` while the
   others wait in their collectives; the profiler keeps its default global ``hang_timeout_s`` (300 s).
   - When the agent's dependencies import on the machine, the real agent runs beside the job and
     ``/api/v1/hang`` is polled: detection and root-cause latency after the stall.
   - Otherwise a stand-in consumer sets the ring header's ``inflight_report_ns`` (as the agent does,
     offsets from docs/formats/ring.md) and times the first CI_STATE_INFLIGHT record of each waiting
     rank: the profiler's half of the latency on real NCCL. The home (raw logs, rings) comes back so the
     agent can replay it here (``comminsight agent run --home``) and name the root cause.
Writes ``summary.json``, ``nvml.json`` and ``home.tar.gz`` into ``--out``.

    python3 scripts/gpu_lab_live.py --plugin /abs/libnccl-profiler-comminsight.so --out DIR [--wheels DIR]
"""

from __future__ import annotations

import argparse
import importlib
import json
import mmap
import os
import shutil
import socket
import struct
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LAB_ENV = {
    "NCCL_NET": "Socket",
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
AGENT_DEPS = ("numpy", "polars", "pyarrow", "cffi", "httpx", "prometheus_client", "zstandard", "typer", "rich")
# docs/formats/ring.md: head at 192, inflight_report_ns at 336, records of 256 bytes after 512; state at 9.
RING_HEAD, RING_REPORT, RING_CAPACITY, RING_HDR, RECORD, STATE_AT = 192, 336, 20, 512, 256, 9
CI_STATE_INFLIGHT = 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nvml_samples(out: list, stop: threading.Event) -> None:
    sys.path.insert(0, str(REPO / "agent"))
    from comminsight.agent.samplers import GpuSampler

    sampler = GpuSampler()
    if not sampler.start():
        out.append({"off": sampler.off_reason})
        return
    while not stop.is_set():
        out.append({"t_ns": time.time_ns(), "devices": sampler.sample()})
        stop.wait(1.0)
    sampler.stop()


def start_job(plugin: str, home: Path, work: Path, ranks: int, hang_step: int) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(ranks):
        env = dict(os.environ, **LAB_ENV)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(ranks),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            NCCL_HOSTID=f"labhost{rank}",
            COMMINSIGHT_HOME=str(home),
            COMMINSIGHT_AGENT_AUTOSTART="0",
            NCCL_PROFILER_PLUGIN=plugin,
            PYTHONUNBUFFERED="1",
        )
        cmd = [sys.executable, str(REPO / "scripts/gpu_lab.py"), "--worker", "--result", str(work / f"r{rank}.json")]
        cmd += ["--steps", "400", "--warmup", "2", "--hang-rank", str(ranks - 1), "--hang-step", str(hang_step)]
        cmd += ["--pg-timeout", "600"]
        log = open(work / f"rank{rank}.log", "w")  # noqa: SIM115 - the process owns it
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def stall_seen(work: Path, ranks: int) -> bool:
    path = work / f"rank{ranks - 1}.log"
    return path.exists() and "stalls before step" in path.read_text(errors="replace")


def watch_with_agent(home: Path, work: Path, ranks: int, limit_s: float) -> dict:
    env = dict(os.environ, COMMINSIGHT_HOME=str(home), COMMINSIGHT_AGENT_LISTEN="127.0.0.1:0")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "agent"), str(REPO / "inject"), env.get("PYTHONPATH", "")])
    env["COMMINSIGHT_WORKLOAD_ID"] = "gpu-lab"
    log = open(work / "agent.log", "w")  # noqa: SIM115
    agent = subprocess.Popen(
        [sys.executable, "-c", "from comminsight.cli import main; main()", "agent", "run"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    import httpx

    marker = home / "metadata/agent/agent.json"
    url = None
    for _ in range(300):
        if marker.exists() and json.loads(marker.read_text() or "{}").get("listen"):
            url = "http://" + json.loads(marker.read_text())["listen"]
            break
        time.sleep(0.1)
    result: dict = {"mode": "agent", "url": url}
    stall = detected = rooted = None
    deadline = time.monotonic() + limit_s
    while url and time.monotonic() < deadline:
        now = time.time_ns()
        if stall is None and stall_seen(work, ranks):
            stall = now
        try:
            hang = httpx.get(f"{url}/api/v1/hang", timeout=2).json()
        except httpx.HTTPError:
            hang = {}
        if hang.get("hang") and detected is None:
            detected = now
        if hang.get("root_cause_ranks") and rooted is None:
            rooted = now
            result.update(root_cause_ranks=hang["root_cause_ranks"], first_stuck=hang.get("first_stuck"))
            result["summary"] = hang.get("summary")
            break
        time.sleep(0.1)
    if url:
        for what in ("steps", "devices"):
            try:
                result[what] = httpx.get(f"{url}/api/v1/{what}", timeout=5).json()
            except httpx.HTTPError as exc:
                result[what] = f"unavailable: {exc}"
    agent.terminate()
    agent.wait(30)
    result["detect_s"] = None if not (stall and detected) else round((detected - stall) / 1e9, 2)
    result["root_cause_s"] = None if not (stall and rooted) else round((rooted - stall) / 1e9, 2)
    result["note"] = "stall time = when the runner saw the stalled rank's log line (up to 0.1 s late)"
    return result


def watch_rings(home: Path, work: Path, ranks: int, limit_s: float, report_s: float) -> dict:
    """Stand-in consumer: ask each ring for in-flight reports; time the first INFLIGHT record per ring."""
    maps: dict[str, mmap.mmap] = {}
    seen_at: dict[str, int] = {}
    stall = None
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and len(seen_at) < ranks - 1:
        now = time.time_ns()
        if stall is None and stall_seen(work, ranks):
            stall = now
        for path in (home / "shms").glob("*.ring"):
            if path.name not in maps:
                with open(path, "r+b") as f:
                    maps[path.name] = mmap.mmap(f.fileno(), 0)
                maps[path.name][RING_REPORT : RING_REPORT + 8] = struct.pack("<Q", int(report_s * 1e9))
            m = maps[path.name]
            head = struct.unpack_from("<Q", m, RING_HEAD)[0]
            cap = struct.unpack_from("<I", m, RING_CAPACITY)[0]
            if path.name in seen_at:
                continue
            for i in range(max(0, head - cap), head):
                if m[RING_HDR + (i % cap) * RECORD + STATE_AT] == CI_STATE_INFLIGHT:
                    seen_at[path.name] = now
                    break
        time.sleep(0.05)
    return {
        "mode": "rings (agent dependencies missing on the device)",
        "inflight_report_s": report_s,
        "first_inflight_after_stall_s": sorted(round((t - stall) / 1e9, 2) for t in seen_at.values()) if stall else [],
        "rings_reporting": len(seen_at),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plugin", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--wheels", help="directory of wheels to put on sys.path (nvidia-ml-py)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--hang-step", type=int, default=60)
    parser.add_argument("--limit-s", type=float, default=90.0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.wheels:
        wheels = [str(p.resolve()) for p in Path(args.wheels).glob("*.whl")]
        sys.path[:0] = wheels
        os.environ["PYTHONPATH"] = os.pathsep.join([*wheels, os.environ.get("PYTHONPATH", "")])
    probe = {}
    for name in AGENT_DEPS:
        try:
            probe[name] = getattr(importlib.import_module(name), "__version__", "present")
        except ImportError as exc:
            probe[name] = f"missing ({exc})"
    summary: dict = {"python": sys.version.split()[0], "deps": probe}
    work = Path("/tmp/ci-live-lab")
    shutil.rmtree(work, ignore_errors=True)
    home = work / "home"
    (home / "metadata/agent").mkdir(parents=True)
    samples: list = []
    stop = threading.Event()
    nvml = threading.Thread(target=nvml_samples, args=(samples, stop), daemon=True)
    nvml.start()
    procs = start_job(args.plugin, home, work, args.ranks, args.hang_step)
    t0 = time.monotonic()
    try:
        if all(not str(v).startswith("missing") for v in probe.values()):
            summary["live"] = watch_with_agent(home, work, args.ranks, args.limit_s)
        else:
            summary["live"] = watch_rings(home, work, args.ranks, args.limit_s, 10.0 / 3)
    finally:
        stop.set()
        for p in procs:
            p.kill()
            p.wait()
    summary["job_s"] = round(time.monotonic() - t0, 1)
    nvml.join(5)
    (out / "nvml.json").write_text(json.dumps(samples, indent=1))
    summary["nvml_samples"] = len([s for s in samples if "devices" in s])
    summary["nvml_first"] = next((s for s in samples if "devices" in s), samples[0] if samples else None)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    for name in ("agent.log", f"rank{args.ranks - 1}.log"):
        if (work / name).exists():
            shutil.copy(work / name, out / name)
    with tarfile.open(out / "home.tar.gz", "w:gz") as tar:
        tar.add(home, arcname="home")
    print(json.dumps(summary, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
