"""Record multi-rank PyTorch profiler (Kineto) traces of a job with a known slow rank, in the GPU lab.

Follows docs/GPU_LAB.md (shared): N NCCL ranks on ``cuda:0`` (``NCCL_HOSTID=labhost<rank>``, socket
transport on loopback, NVLink multicast off). Each rank trains a small MLP under DDP (small buckets,
so several all-reduces per step) and all-reduces its loss in a sub-group (first half / second half of
the ranks). Rank ``--slow-rank`` sleeps ``--slow-ms`` on the CPU before its backward pass every step,
so it launches its DDP all-reduces last and the others wait for it inside the NCCL kernels: the
ground truth is written next to the traces (``meta.json``).

``torch.profiler`` runs with a schedule (wait, warmup, active), so the traced steps carry
``ProfilerStep#N`` spans; each rank writes one gzipped Chrome-trace JSON. With ``--plugin`` the
CommInsight profiler is loaded too (the straggler scenario in its raw logs: same run, same truth).
Everything lands in one tarball (traces, meta, raw logs) so it travels back as one file.

    python3 scripts/gpu_lab_kineto.py --out DIR [--plugin /abs/libnccl-profiler-comminsight.so]
    python3 scripts/gpu_lab_kineto.py --out DIR --backend gloo --ranks 4   # CPU dry run
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_lab import LAB_ENV, _free_port, read_logs


def worker(args: argparse.Namespace) -> None:
    """One rank: profiled DDP steps plus a sub-group all-reduce; the slow rank sleeps before backward."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.profiler import ProfilerActivity, profile, schedule

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = args.backend == "nccl"
    device = torch.device("cuda:0") if cuda else torch.device("cpu")
    extra = {"device_id": device} if cuda else {}
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120), **extra)
    half = world // 2
    groups = [dist.new_group(list(range(half))), dist.new_group(list(range(half, world)))]
    mine = groups[0] if rank < half else groups[1]

    torch.manual_seed(0)
    width = args.width
    layers = [torch.nn.Linear(512, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 16)).to(device)
    # 1 MB buckets: a few DDP all-reduces per step instead of one
    ddp = DistributedDataParallel(model, device_ids=[0] if cuda else None, bucket_cap_mb=1)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    generator = torch.Generator(device=device).manual_seed(rank)
    x = torch.randn(256, 512, device=device, generator=generator)
    y = torch.randn(256, 16, device=device, generator=generator)

    trace_dir = Path(args.trace_dir)

    def on_ready(prof: profile) -> None:
        plain = trace_dir / f"rank{rank}.pt.trace.json"
        prof.export_chrome_trace(str(plain))
        with plain.open("rb") as src, gzip.open(f"{plain}.gz", "wb", compresslevel=9) as dst:
            shutil.copyfileobj(src, dst)
        plain.unlink()

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    plan = schedule(wait=args.prof_wait, warmup=args.prof_warmup, active=args.prof_active, repeat=1)
    times = []
    with profile(activities=activities, schedule=plan, on_trace_ready=on_ready, record_shapes=True) as prof:
        for _ in range(args.steps):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = ((ddp(x) - y) ** 2).mean()
            if rank == args.slow_rank:
                time.sleep(args.slow_ms / 1e3)  # the injected straggler: late to every collective of the step
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            shared = loss.detach().clone()
            dist.all_reduce(shared, group=mine)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            prof.step()
    dist.barrier()
    dist.destroy_process_group()
    Path(args.result).write_text(json.dumps({"rank": rank, "step_s": times}))


def versions() -> dict:
    """PyTorch, NCCL and GPU as this machine reports them."""
    try:
        import torch

        info = {"torch": torch.__version__}
        if torch.cuda.is_available():
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
            info["gpu"] = torch.cuda.get_device_name(0)
        return info
    except Exception as exc:  # the meta file still says what failed
        return {"error": repr(exc)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--trace-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="bench/results/gpu_lab_kineto")
    parser.add_argument("--work", default="/tmp/comminsight-gpu-lab-kineto")
    parser.add_argument("--plugin", help="absolute path of libnccl-profiler-comminsight.so (optional)")
    parser.add_argument("--backend", default="nccl", choices=["nccl", "gloo"], help="gloo: CPU dry run")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12, help="steps run (the profiler traces a window of them)")
    parser.add_argument("--prof-wait", type=int, default=2)
    parser.add_argument("--prof-warmup", type=int, default=2)
    parser.add_argument("--prof-active", type=int, default=6)
    parser.add_argument("--slow-rank", type=int, default=5)
    parser.add_argument("--slow-ms", type=float, default=30.0)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--timeout", type=float, default=150.0)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0

    out, work = Path(args.out), Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    traces, home = work / "traces", work / "home"
    for d in (out, traces, home):
        d.mkdir(parents=True, exist_ok=True)
    plugin = str(Path(args.plugin).resolve()) if args.plugin else None
    port = _free_port()
    procs, logs = [], []
    started = time.monotonic()
    for rank in range(args.ranks):
        env = {k: v for k, v in os.environ.items() if k != "NCCL_PROFILER_PLUGIN"}
        env.update(LAB_ENV)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(args.ranks),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            NCCL_HOSTID=f"labhost{rank}",
            COMMINSIGHT_HOME=str(home),
            COMMINSIGHT_AGENT_AUTOSTART="0",
            PYTHONUNBUFFERED="1",
        )
        if plugin:
            env["NCCL_PROFILER_PLUGIN"] = plugin
        log = open(work / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        logs.append(log)
        cmd = [sys.executable, __file__, "--worker", "--result", str(work / f"rank{rank}.json")]
        cmd += ["--trace-dir", str(traces), "--backend", args.backend, "--steps", str(args.steps)]
        cmd += ["--prof-wait", str(args.prof_wait), "--prof-warmup", str(args.prof_warmup)]
        cmd += ["--prof-active", str(args.prof_active), "--slow-rank", str(args.slow_rank)]
        cmd += ["--slow-ms", str(args.slow_ms), "--width", str(args.width)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = started + args.timeout
    codes: list = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append("timeout")
    for log in logs:
        log.close()
    elapsed = time.monotonic() - started

    step_ms = {}
    for rank in range(args.ranks):
        path = work / f"rank{rank}.json"
        if path.exists():
            step_ms[rank] = [round(t * 1e3, 3) for t in json.loads(path.read_text())["step_s"]]
    files = sorted(traces.glob("*.json.gz"))
    meta = {
        "what": "multi-rank Kineto traces, GPU lab (docs/GPU_LAB.md recipe), one injected slow rank",
        "script": "scripts/gpu_lab_kineto.py",
        "command": " ".join(sys.argv),
        "recorded_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": versions(),
        "backend": args.backend,
        "ranks": args.ranks,
        "steps_run": args.steps,
        "profiler_schedule": {"wait": args.prof_wait, "warmup": args.prof_warmup, "active": args.prof_active},
        "ground_truth": {
            "slow_rank": args.slow_rank,
            "injected": f"rank {args.slow_rank} sleeps {args.slow_ms} ms on the CPU before backward, every step",
        },
        "communicators": {
            "world": list(range(args.ranks)),
            "subgroups": [[*range(args.ranks // 2)], [*range(args.ranks // 2, args.ranks)]],
        },
        "plugin_loaded": bool(plugin),
        "exit_codes": [str(c) for c in codes],
        "elapsed_s": round(elapsed, 1),
        "median_step_ms": {r: statistics.median(v) for r, v in step_ms.items()},
        "trace_files": {p.name: p.stat().st_size for p in files},
    }
    if plugin:
        records, segments = read_logs(home / "inspector_logs")
        meta["plugin_records"] = len(records)
        meta["plugin_segments"] = len(segments)
    (traces / "meta.json").write_text(json.dumps(meta, indent=2))
    with tarfile.open(out / "kineto_gpu_lab.tar.gz", "w:gz") as tar:
        tar.add(traces, arcname="kineto")
        if plugin and (home / "inspector_logs").is_dir():
            tar.add(home / "inspector_logs", arcname="straggler_rawlogs/inspector_logs")
    with open(out / "kineto_ranks.log", "w") as combined:
        for log in sorted(work.glob("rank*.log")):
            combined.write(f"==== {log.name}\n{log.read_text(errors='replace')[-3000:]}\n")
    print(json.dumps({k: v for k, v in meta.items() if k != "communicators"}, indent=1))
    ok = len(files) == args.ranks and all(c == 0 for c in codes)
    print(f"KINETO {'OK' if ok else 'FAILED'}: {len(files)} trace files, codes {codes}, {elapsed:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
