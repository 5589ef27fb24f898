"""Real NCCL on one GPU: prove the CommInsight profiler inside a DDP job and measure its overhead.

Follows docs/GPU_LAB.md (shared): N NCCL ranks, all on ``cuda:0``, each believing it is its own host
(``NCCL_HOSTID=labhost<rank>``), talking over the socket transport on loopback, NVLink multicast off.
Each rank trains a small MLP under DDP and all-reduces its loss in a sub-group (first half / second
half of the ranks) every step. The same job runs with the plugin (``NCCL_PROFILER_PLUGIN``) and without
it, alternating, so the step-time ratio compares like with like.

With the plugin the script then reads every raw-log segment back (numpy over the records, layout
derived from ``native/profiler/include/comminsight_ring.h``, so no hand-copied struct) and checks:
every collective of every rank is there, joinable across ranks by (commHash, func, seq) with exactly
one record per rank, sequence numbers contiguous, completed, with GPU start/end times. It needs only
PyTorch and numpy (the device machine has no project virtualenv).

    python3 scripts/gpu_lab.py --plugin /abs/libnccl-profiler-comminsight.so --out DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
HEADER = REPO / "native/profiler/include/comminsight_ring.h"
LAB_ENV = {
    "NCCL_NET": "Socket",
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    # a rule of the device machine: never NVLink multicast
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
STATE_COMPLETED = 1
FLAG_GPU_TIMES = 1


# ---------------------------------------------------------------- worker (one rank)


def worker(args: argparse.Namespace) -> None:
    """One rank: DDP training of a small MLP plus a sub-group all-reduce per step; writes its step times."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=args.pg_timeout)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device, timeout=timeout)
    half = world // 2
    groups = [dist.new_group(list(range(half))), dist.new_group(list(range(half, world)))]
    mine = groups[0] if rank < half else groups[1]

    torch.manual_seed(0)
    layers = [torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(1024, 16)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[0])
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    generator = torch.Generator(device=device).manual_seed(rank)
    x = torch.randn(256, 512, device=device, generator=generator)
    y = torch.randn(256, 16, device=device, generator=generator)

    times = []
    for step in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if rank == args.hang_rank and step == args.hang_step:
            # the injected fault: this rank never reaches the step's collectives, the others wait in them
            print(f"rank {rank} stalls before step {step}", flush=True)
            time.sleep(3600)
        loss = ((ddp(x) - y) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        shared = loss.detach().clone()
        dist.all_reduce(shared, group=mine)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    result = {"rank": rank, "step_s": times[args.warmup :], "subgroup_allreduces": args.warmup + args.steps}
    Path(args.result).write_text(json.dumps(result))


# ---------------------------------------------------------------- reading the raw logs back


def _struct_dtype(header_text: str, name: str) -> np.dtype:
    """numpy dtype of C struct ``name`` from the contract header (natural alignment, as the C compiler lays it)."""
    body = re.search(r"typedef struct " + name + r" \{(.*?)\} " + name + ";", header_text, re.S)
    if body is None:
        raise ValueError(f"struct {name} not in {HEADER}")
    sizes = {"uint8_t": ("u1", 1), "int32_t": ("<i4", 4), "uint32_t": ("<u4", 4), "uint64_t": ("<u8", 8)}
    names, formats, offsets, offset = [], [], [], 0
    for ctype, field, length in re.findall(r"^\s*(\w+)\s+(\w+)(?:\[(\d+)\])?;", body.group(1), re.M):
        if ctype == "char":
            fmt, align, size = f"S{length}", 1, int(length)
        else:
            fmt, align = sizes[ctype]
            size = align * (int(length) if length else 1)
            if length:
                fmt = (fmt, int(length))
        offset = (offset + align - 1) // align * align
        names.append(field)
        formats.append(fmt)
        offsets.append(offset)
        offset += size
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": offset})


def _checksums(records: np.ndarray) -> np.ndarray:
    words = records.view("<u4").reshape(len(records), -1).copy()
    words[:, 1] = 0
    h = np.full(len(records), 2166136261, dtype=np.uint32)
    with np.errstate(over="ignore"):
        for column in range(words.shape[1]):
            h = (h ^ words[:, column]) * np.uint32(16777619)
    return h


def read_logs(log_dir: Path) -> tuple[np.ndarray, list[dict]]:
    """All valid records of every segment under ``log_dir``, and one summary per segment."""
    text = HEADER.read_text()
    rec_dt, hdr_dt = _struct_dtype(text, "ci_op_record"), _struct_dtype(text, "ci_log_header")
    if (rec_dt.itemsize, hdr_dt.itemsize) != (256, 512):
        raise ValueError(f"layout derived from {HEADER} is off: {rec_dt.itemsize}, {hdr_dt.itemsize}")
    parts, segments = [], []
    for path in sorted(log_dir.glob("*.cilog*")):
        data = path.read_bytes()
        header = np.frombuffer(data, hdr_dt, count=1)[0]
        n = (len(data) - 512) // 256
        records = np.frombuffer(data, rec_dt, count=n, offset=512)
        valid = (records["magic"] == 0x43524943) & (records["checksum"] == _checksums(records))
        segments.append(
            {
                "file": path.name,
                "magic_ok": int(header["magic"]) == 0x474F4C4D4D4F4343,
                "records": int(n),
                "invalid": int((~valid).sum()),
                "torn_bytes": (len(data) - 512) % 256,
            }
        )
        parts.append(records[valid])
    return (np.concatenate(parts) if parts else np.zeros(0, rec_dt)), segments


def check_logs(records: np.ndarray, world: int, subgroup_ops: int) -> dict:
    """The proof: every collective of every rank present, joinable across ranks, complete, GPU-timed."""
    report: dict = {"records": len(records), "problems": []}
    problems = report["problems"]
    if len(records) == 0:
        problems.append("no records")
        return report
    funcs = np.char.decode(records["func"], "ascii")
    report["states"] = {int(s): int(c) for s, c in zip(*np.unique(records["state"], return_counts=True), strict=True)}
    report["by_func"] = {str(f): int(c) for f, c in zip(*np.unique(funcs, return_counts=True), strict=True)}
    not_done = int((records["state"] != STATE_COMPLETED).sum())
    if not_done:
        problems.append(f"{not_done} records not completed")
    gpu = (records["flags"] & FLAG_GPU_TIMES) != 0
    report["gpu_times_fraction"] = float(gpu.mean())
    if not gpu.all():
        problems.append(f"{int((~gpu).sum())} records without GPU start/end")
    ordered = records["gpu_end_ns"][gpu] >= records["gpu_start_ns"][gpu]
    if not ordered.all():
        problems.append(f"{int((~ordered).sum())} records with gpu_end < gpu_start")
    comms = []
    for comm in np.unique(records["comm_hash"]):
        in_comm = records["comm_hash"] == comm
        nranks = int(records["nranks"][in_comm][0])
        ranks = sorted({int(r) for r in np.unique(records["rank"][in_comm])})
        entry = {"comm_hash": int(comm), "nranks": nranks, "ranks_seen": len(ranks), "funcs": {}}
        if ranks != list(range(nranks)):
            problems.append(f"comm {int(comm):#x}: ranks {ranks} of {nranks}")
        for func in np.unique(funcs[in_comm]):
            sel = in_comm & (funcs == func)
            keys = np.stack([records["rank"][sel].astype(np.int64), records["seq"][sel].astype(np.int64)], axis=1)
            if len(np.unique(keys, axis=0)) != len(keys):
                problems.append(f"comm {int(comm):#x} {func}: duplicate (rank, seq)")
            seqs, per_seq = np.unique(records["seq"][sel], return_counts=True)
            # joinable: each (commHash, func, seq) has one record on every rank of the communicator
            if not (per_seq == nranks).all():
                problems.append(f"comm {int(comm):#x} {func}: {int((per_seq != nranks).sum())} seqs not on all ranks")
            if not np.array_equal(seqs, np.arange(len(seqs))):
                problems.append(f"comm {int(comm):#x} {func}: seq not contiguous from 0")
            entry["funcs"][str(func)] = len(seqs)
        comms.append(entry)
        if nranks == world // 2 and entry["funcs"].get("AllReduce", 0) < subgroup_ops:
            problems.append(f"sub-group comm {int(comm):#x}: {entry['funcs'].get('AllReduce', 0)} < {subgroup_ops}")
    report["communicators"] = comms
    subgroups = [c for c in comms if c["nranks"] == world // 2 and c["funcs"].get("AllReduce", 0) >= subgroup_ops]
    if len(subgroups) != 2:
        problems.append(f"expected 2 sub-group communicators with {subgroup_ops} AllReduce, saw {len(subgroups)}")
    done = records[records["state"] == STATE_COMPLETED]
    gpu_ns = (done["gpu_end_ns"] - done["gpu_start_ns"]).astype(np.int64)
    report["median_gpu_us"] = float(np.median(gpu_ns) / 1e3) if len(done) else None
    report["median_enqueue_to_complete_us"] = (
        float(np.median((done["complete_ns"] - done["enqueue_start_ns"]).astype(np.int64)) / 1e3) if len(done) else None
    )
    return report


def hang_report(home: Path, world: int) -> dict:
    """What the evidence says after the last rank stalled: where did the others wait, and which rank is missing."""
    report: dict = {"evidence_files": sorted(p.name for p in (home / "hang_detection").glob("*.json"))}
    waiting = {}
    for path in (home / "hang_detection").glob("*.json"):
        evidence = json.loads(path.read_text())
        for op in evidence["operations"]:
            waiting.setdefault((op["comm_hash"], op["func"], op["seq"]), set()).add((op["rank"], op["nranks"]))
    report["waiting_ops"] = [
        {"comm_hash": k[0], "func": k[1], "seq": k[2], "ranks": sorted(r for r, _ in v), "nranks": max(n for _, n in v)}
        for k, v in sorted(waiting.items())
    ]
    records, _ = read_logs(home / "inspector_logs")
    if len(records):
        report["record_states"] = {
            int(s): int(c) for s, c in zip(*np.unique(records["state"], return_counts=True), strict=True)
        }
    world_ops = [op for op in report["waiting_ops"] if op["nranks"] == world]
    if world_ops:
        missing = sorted(set(range(world)) - set(world_ops[0]["ranks"]))
        report["diagnosis"] = f"ranks {world_ops[0]['ranks']} wait in {world_ops[0]['func']} seq {world_ops[0]['seq']}"
        report["missing_ranks"] = missing
    return report


# ---------------------------------------------------------------- orchestration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_phase(
    name: str, plugin: str | None, args: argparse.Namespace, work: Path, hang: bool = False, timeout: float = 0
) -> dict:
    """Runs the N ranks once; returns their results (step times) and the home used."""
    home = work / f"home_{name}"
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    port = _free_port()
    procs, logs = [], []
    for rank in range(args.ranks):
        env = {k: v for k, v in os.environ.items() if k != "NCCL_PROFILER_PLUGIN"}
        env.update(LAB_ENV)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(args.ranks),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            NCCL_HOSTID=f"labhost{rank}",
            COMMINSIGHT_HOME=str(home),
            COMMINSIGHT_AGENT_AUTOSTART="0",
            COMMINSIGHT_HANG_TIMEOUT_S=str(args.hang_timeout if hang else 300),
            PYTHONUNBUFFERED="1",
        )
        if plugin:
            env["NCCL_PROFILER_PLUGIN"] = plugin
        log = open(work / f"{name}_rank{rank}.log", "w")  # noqa: SIM115 - closed below
        logs.append(log)
        cmd = [sys.executable, __file__, "--worker", "--result", str(work / f"{name}_rank{rank}.json")]
        cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
        if hang:
            # tear-down mode: the watchdog aborts the communicators (NCCL calls the profiler's finalize)
            env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
            cmd += ["--hang-rank", str(args.ranks - 1), "--hang-step", "3", "--pg-timeout", str(args.pg_timeout)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    t0 = time.monotonic()
    deadline = t0 + (timeout or args.phase_timeout)
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append("timeout")
    for log in logs:
        log.close()
    results = []
    for rank in range(args.ranks):
        path = work / f"{name}_rank{rank}.json"
        if path.exists():
            results.append(json.loads(path.read_text()))
    steps = [t for r in results for t in r["step_s"]]
    print(f"[{name}] exit codes {codes}, {time.monotonic() - t0:.1f} s, {len(results)} results", flush=True)
    return {
        "name": name,
        "plugin": bool(plugin),
        "codes": codes,
        "results": results,
        "home": home,
        "median_step_s": statistics.median(steps) if steps else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--plugin", help="absolute path of libnccl-profiler-comminsight.so")
    parser.add_argument("--out", default="bench/results/gpu_lab", help="where the summary goes")
    parser.add_argument("--work", default="/tmp/comminsight-gpu-lab", help="scratch: homes, rank logs")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="without/with pairs, alternating")
    parser.add_argument("--phase-timeout", type=float, default=150.0)
    parser.add_argument("--hang", action="store_true", help="also run the hang scenario (last rank stalls)")
    parser.add_argument("--hang-timeout", type=int, default=5, help="COMMINSIGHT_HANG_TIMEOUT_S in the hang run")
    parser.add_argument("--hang-rank", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--hang-step", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--pg-timeout", type=float, default=600.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0

    plugin = str(Path(args.plugin).resolve()) if args.plugin else None
    if plugin is None or not Path(plugin).is_file():
        print(f"plugin not found: {args.plugin}", file=sys.stderr)
        return 2
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    try:
        import torch

        versions = {"torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
        versions["gpu"] = torch.cuda.get_device_name(0)
    except Exception as exc:  # the summary still says what failed
        versions = {"error": repr(exc)}
    print(f"versions: {versions}", flush=True)

    phases = []
    for round_no in range(args.rounds):
        for name, lib in ((f"without{round_no}", None), (f"with{round_no}", plugin)):
            phases.append(run_phase(name, lib, args, work))
            # progress on disk after every phase: a call cut short still brings back the rounds it ran
            done = [
                {"name": p["name"], "codes": [str(c) for c in p["codes"]], "step_s": p["median_step_s"]} for p in phases
            ]
            (out / "gpu_lab.json").write_text(json.dumps({"versions": versions, "partial": True, "phases": done}))
    with_steps = [t for p in phases if p["plugin"] for r in p["results"] for t in r["step_s"]]
    without_steps = [t for p in phases if not p["plugin"] for r in p["results"] for t in r["step_s"]]

    summary: dict = {"versions": versions, "ranks": args.ranks, "steps": args.steps, "warmup": args.warmup}
    summary["phases"] = [
        {"name": p["name"], "codes": [str(c) for c in p["codes"]], "median_step_s": p["median_step_s"]} for p in phases
    ]
    if with_steps and without_steps:
        summary["median_step_ms_with"] = statistics.median(with_steps) * 1e3
        summary["median_step_ms_without"] = statistics.median(without_steps) * 1e3
        summary["step_time_ratio_with_over_without"] = statistics.median(with_steps) / statistics.median(without_steps)
        summary["mean_step_time_ratio"] = statistics.mean(with_steps) / statistics.mean(without_steps)

    # the proof uses the last phase with the plugin (its homes hold the logs)
    last_with = [p for p in phases if p["plugin"]][-1]
    home = last_with["home"]
    records, segments = read_logs(home / "inspector_logs")
    summary["segments"] = segments
    subgroup_ops = args.warmup + args.steps
    summary["proof"] = check_logs(records, args.ranks, subgroup_ops)
    summary["rings"] = sorted(p.name for p in (home / "shms").glob("*"))
    summary["hang_evidence_files"] = sorted(p.name for p in (home / "hang_detection").glob("*"))
    warnings = []
    for log in sorted(work.glob("with*_rank*.log")):
        warnings += [line.strip() for line in log.read_text(errors="replace").splitlines() if "comminsight" in line]
    summary["plugin_warnings"] = warnings[:20]
    with tarfile.open(out / "gpu_lab_logs.tar.gz", "w:gz") as tar:
        tar.add(home / "inspector_logs", arcname="inspector_logs")
        tar.add(home / "hang_detection", arcname="hang_detection")

    if args.hang:
        args.pg_timeout = 20.0
        phase = run_phase("hang", plugin, args, work, hang=True, timeout=75)
        summary["hang"] = hang_report(phase["home"], args.ranks)
    with open(out / "gpu_lab_ranks.log", "w") as combined:
        for log in sorted(work.glob("*_rank*.log")):
            combined.write(f"==== {log.name}\n{log.read_text(errors='replace')[-4000:]}\n")

    (out / "gpu_lab.json").write_text(json.dumps(summary, indent=2, default=str))
    proof = summary["proof"]
    print(json.dumps({k: v for k, v in summary.items() if k not in ("segments",)}, indent=2, default=str))
    ok = not proof["problems"] and all(c == 0 for p in phases for c in p["codes"])
    print(f"GPU LAB {'PASSED' if ok else 'FAILED'}: {proof['records']} records, problems: {proof['problems'][:10]}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
