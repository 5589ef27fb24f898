"""Benchmark: straggler analysis against HolisticTraceAnalysis's ``get_potential_stragglers``.

Both tools read the same multi-rank PyTorch profiler (Kineto) traces; the time ratio counts loading
plus analysis for each, and the two answers are printed side by side with the ground truth.

Traces used, in order:
- RECORDED (default when present): ``tests/data/kineto_gpu_lab_8rank/`` — 8 NCCL ranks recorded in the
  GPU lab on an H200 with ``scripts/gpu_lab_kineto.py`` (DDP + a sub-group all-reduce, rank 5 sleeping
  30 ms before backward every step; see that folder's README.md and meta.json for the truth).
  HTA 0.5 only treats kernels named ``ncclKernel*`` as communication; NCCL >= 2.19 names them
  ``ncclDevKernel_*``, so on these traces HTA fails as shipped. The benchmark reports that, then runs
  HTA again on a copy with the kernels renamed to the old prefix (the only change), so both answers exist.
- SYNTHETIC (``--synthetic``, or when the recorded folder is absent): generated in a temp dir from a
  seeded generator: one JSON trace per rank with ``ProfilerStep#N`` annotations, compute kernels,
  ``cudaLaunchKernel`` runtime events and NCCL all-reduce kernels (NCCL 2.17 names, which HTA
  recognises) with the collective args PyTorch writes. One rank (``--slow-rank``) computes
  ``--slow-factor`` times slower, so it reaches every all-reduce last while the others wait.

- ``--sets``: several of the above in one run, by name: ``recorded``, ``small`` (generated, 8 ranks x 20
  steps, 1 GEMM per bucket, 2.0 MB), ``medium`` (8 GEMMs per bucket, 8.4 MB), ``large`` (40 steps,
  24 GEMMs per bucket, 46 MB); a summary table of every ratio closes the run.

Two measures, both printed with the median over rounds and the range:
- in one process (``--rounds``): both tools imported and run once first, then alternately, each after
  a full garbage collection; wall seconds and CPU seconds (HTA's parse workers included);
- in fresh processes (``--cold-rounds``), as a user runs each: ``comminsight analyze stragglers DIR
  --format json`` against a three-line HTA script, alternately, imports included. Each runs once first,
  not counted, with ``PYTHONDONTWRITEBYTECODE`` removed from its environment, so both start from
  bytecode caches as an installed package does (pip compiles them at install; HTA's are in
  site-packages) and the traces are in the page cache for both. With ``--baseline REV`` the command of
  this repository's commit REV (``git archive`` of it, run with this Python) takes its turn in each
  round too, and the summary gives old / new CPU seconds: old code against new in the same run.

HTA is a benchmark-only dependency (requirements/bench.txt); without it the comparison is skipped
with a message and only CommInsight is timed.

    .venv/bin/python bench/stragglers.py [--traces DIR | --synthetic [--ranks 8] [--steps 20] [--slow-rank 5]
        | --sets recorded,small,medium,large] [--rounds 9] [--cold-rounds 5] [--baseline REV]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RECORDED = ROOT / "tests/data/kineto_gpu_lab_8rank"


def write_traces(
    out: Path, ranks: int, steps: int, slow_rank: int, slow_factor: float, kernels: int = 1, seed: int = 0
) -> None:
    """One Kineto JSON per rank; see the module doc."""
    rng = np.random.default_rng(seed)
    buckets, compute_us, transfer_us, nelems = 6, 900.0, 250.0, 6_291_456
    group = list(range(ranks))
    clock = np.zeros(ranks)
    events: list[list[dict]] = [[] for _ in range(ranks)]
    ext = [1000] * ranks
    corr = [50_000] * ranks

    def launch(
        r: int, name: str, ts: float, dur: float, stream: int, cat: str = "kernel", args: dict | None = None
    ) -> None:
        ext[r] += 1
        corr[r] += 1
        if cat == "kernel" and not name.startswith("nccl"):
            # the ATen op that launched it, with the shapes record_shapes=True writes
            events[r].append(
                {
                    "ph": "X",
                    "cat": "cpu_op",
                    "name": "aten::mm",
                    "pid": 100 + r,
                    "tid": 100 + r,
                    "ts": ts - 12.0,
                    "dur": 9.0,
                    "args": {
                        "External id": ext[r],
                        "Record function id": 0,
                        "Sequence number": ext[r],
                        "Fwd thread id": 0,
                        "Concrete Inputs": ["", ""],
                        "Input type": ["c10::BFloat16", "c10::BFloat16"],
                        "Input Strides": [[4096, 1], [1, 4096]],
                        "Input Dims": [[8192, 4096], [4096, 4096]],
                        "Ev Idx": ext[r],
                    },
                }
            )
            events[r].append(
                {"ph": "s", "id": corr[r], "pid": 100 + r, "tid": 100 + r, "ts": ts - 8, "cat": "ac2g", "name": "ac2g"}
            )
        events[r].append(
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": "cudaLaunchKernel",
                "pid": 100 + r,
                "tid": 100 + r,
                "ts": ts - 8.0,
                "dur": 4.0,
                "args": {"External id": ext[r], "correlation": corr[r], "cbid": 211},
            }
        )
        events[r].append(
            {
                "ph": "X",
                "cat": cat,
                "name": name,
                "pid": 0,
                "tid": stream,
                "ts": ts,
                "dur": dur,
                "args": {
                    "External id": ext[r],
                    "correlation": corr[r],
                    "device": r,
                    "stream": stream,
                    "queued": 0,
                    **(args or {}),
                },
            }
        )

    for step in range(steps):
        step_start = clock.copy()
        for _ in range(buckets):
            arrival = np.empty(ranks)
            for r in range(ranks):
                work = compute_us * rng.normal(1.0, 0.03) * (slow_factor if r == slow_rank else 1.0)
                at = clock[r] + 5.0
                for _ in range(kernels):  # the bucket's compute, as ``kernels`` GEMMs back to back
                    launch(r, "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", at, work / kernels, 7)
                    at += work / kernels
                arrival[r] = at
            end = arrival.max() + transfer_us
            for r in range(ranks):
                ext[r] += 1
                events[r].append(
                    {
                        "ph": "X",
                        "cat": "cpu_op",
                        "name": "record_param_comms",
                        "pid": 100 + r,
                        "tid": 100 + r,
                        "ts": arrival[r] - 20.0,
                        "dur": 10.0,
                        "args": {
                            "External id": ext[r],
                            "Collective name": "allreduce",
                            "In msg nelems": nelems,
                            "Out msg nelems": nelems,
                            "Group size": ranks,
                            "dtype": "BFloat16",
                            "Process Group Name": "0",
                            "Process Group Description": "default_pg",
                            "Process Group Ranks": json.dumps(group),
                        },
                    }
                )
                launch(
                    r,
                    "ncclKernel_AllReduce_RING_LL_Sum_bfloat16(ncclDevComm*, unsigned long, ncclWork*)",
                    arrival[r],
                    end - arrival[r],
                    20,
                    args={
                        "Collective name": "allreduce",
                        "In msg nelems": nelems,
                        "Out msg nelems": nelems,
                        "Group size": ranks,
                        "dtype": "BFloat16",
                        "Process Group Name": "0",
                        "Process Group Description": "default_pg",
                        "Process Group Ranks": json.dumps(group),
                    },
                )
                clock[r] = end
        for r in range(ranks):
            events[r].append(
                {
                    "ph": "X",
                    "cat": "user_annotation",
                    "name": f"ProfilerStep#{step}",
                    "pid": 100 + r,
                    "tid": 100 + r,
                    "ts": step_start[r] - 20.0,
                    "dur": clock[r] - step_start[r] + 30.0,
                    "args": {"External id": 0},
                }
            )
        clock += 40.0  # optimizer step
    for r in range(ranks):
        doc = {
            "schemaVersion": 1,
            "deviceProperties": [{"id": r, "name": "NVIDIA H200", "totalGlobalMem": 150_000_000_000}],
            "distributedInfo": {
                "backend": "nccl",
                "rank": r,
                "world_size": ranks,
                "pg_count": 1,
                "pg_config": [
                    {
                        "pg_name": "0",
                        "pg_desc": "default_pg",
                        "backend_config": "cuda:nccl",
                        "pg_size": ranks,
                        "ranks": group,
                    }
                ],
                "nccl_version": "2.17.1",
            },
            "traceEvents": sorted(events[r], key=lambda e: e["ts"]),
            "traceName": f"rank{r}.json",
            "displayTimeUnit": "ms",
            "baseTimeNanoseconds": 1_700_000_000_000_000_000,
        }
        (out / f"rank-{r}.pt.trace.json").write_text(json.dumps(doc))


def run_comminsight(trace_dir: Path) -> tuple[float, float, list[int], dict]:
    """(load seconds, analysis seconds, culprits, slowdown)."""
    from comminsight.analysis.stragglers import analyse_stragglers
    from comminsight.importers import load

    t0 = time.perf_counter()
    table = load(trace_dir)
    t1 = time.perf_counter()
    report = analyse_stragglers(table)
    return t1 - t0, time.perf_counter() - t1, report.culprits, report.slowdown


def run_hta(trace_dir: Path) -> tuple[float, float, list[int]] | str:
    """(parse seconds, analysis seconds, answer) or why HTA could not run."""
    try:
        from hta.trace_analysis import TraceAnalysis
    except ImportError:
        return "HolisticTraceAnalysis is not installed (pip install -r requirements/bench.txt): comparison skipped"
    t0 = time.perf_counter()
    try:
        with _quiet():
            analysis = TraceAnalysis(trace_dir=str(trace_dir))
            t1 = time.perf_counter()
            answer = analysis.get_potential_stragglers(num_candidates=1)
    except Exception as exc:
        return f"HTA failed on these traces: {type(exc).__name__}: {exc}"
    return t1 - t0, time.perf_counter() - t1, [int(r) for r in answer]


def _cpu_seconds() -> float:
    """User + system CPU of this process and its reaped children (HTA's parse workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """HTA and its parse workers log every file they read to stderr and stdout: both go to /dev/null."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


def copy_recorded(src: Path, dst: Path, rename_kernels: bool = False) -> int:
    """Copies the per-rank traces of ``src`` into ``dst`` (optionally with NCCL kernels renamed for HTA)."""
    total = 0
    for path in sorted(src.glob("*.pt.trace.json.gz")):
        data = path.read_bytes()
        if rename_kernels:
            # HTA 0.5 recognises communication kernels by the pre-2.19 prefix only
            data = gzip.compress(gzip.decompress(data).replace(b'"ncclDevKernel_', b'"ncclKernel_'), compresslevel=1)
        (dst / path.name).write_bytes(data)
        total += len(data)
    return total


def _spread(values: list[float]) -> str:
    return f"x{statistics.median(values):.1f} (x{min(values):.1f}-x{max(values):.1f})"


def report(trace_dir: Path, truth: str, rounds: int, hta_dir: Path | None = None) -> dict[str, str]:
    """Runs both tools on ``trace_dir``, alternately for ``rounds`` rounds, and prints the answers and
    the time ratio (median over rounds of HTA's seconds over CommInsight's, each end to end: reading
    the traces plus the straggler analysis, in this process, after both tools were imported and ran
    once, each after a full garbage collection)."""
    hta = run_hta(trace_dir)
    if isinstance(hta, str):
        print(hta)
        if hta_dir is None or hta.startswith("HolisticTraceAnalysis is not installed"):
            ours_load, ours_run, culprits, slowdown = run_comminsight(trace_dir)
            print(f"CommInsight: load {ours_load:.3f} s + analysis {ours_run:.3f} s; culprits {culprits}")
            return {}
        print("HTA again, on a copy with ncclDevKernel_* renamed ncclKernel_* (its pre-NCCL-2.19 prefix):")
        trace_for_hta = hta_dir
    else:
        trace_for_hta = trace_dir
    # HTA's first run above warmed it (lazy imports, caches); CommInsight gets the same first run.
    cold_load, cold_run, _, _ = run_comminsight(trace_dir)
    print(f"first runs, not counted: CommInsight {cold_load + cold_run:.3f} s (HTA's: the probe above)")
    ours_times, hta_times, ratios, cpu_ratios = [], [], [], []
    for round_ in range(rounds):
        # A full collection before each tool: neither pays, inside its timing, for the other's garbage.
        gc.collect()
        cpu0 = _cpu_seconds()
        ours_load, ours_run, culprits, slowdown = run_comminsight(trace_dir)
        cpu1 = _cpu_seconds()
        gc.collect()
        cpu_hta = _cpu_seconds()
        hta = run_hta(trace_for_hta)
        cpu2 = _cpu_seconds()
        if isinstance(hta, str):
            print(hta)
            return {}
        hta_parse, hta_run, hta_answer = hta
        ours, theirs = ours_load + ours_run, hta_parse + hta_run
        ours_times.append(ours)
        hta_times.append(theirs)
        ratios.append(theirs / ours)
        cpu_ratios.append((cpu2 - cpu_hta) / (cpu1 - cpu0))
        print(
            f"round {round_ + 1}: CommInsight load {ours_load:.3f} s + analysis {ours_run:.3f} s = {ours:.3f} s "
            f"(CPU {cpu1 - cpu0:.3f} s); HTA parse {hta_parse:.3f} s + get_potential_stragglers {hta_run:.3f} s = "
            f"{theirs:.3f} s (CPU {cpu2 - cpu_hta:.3f} s, its parse workers included); x{theirs / ours:.1f}; "
            f"load average {os.getloadavg()[0]:.1f}"
        )
    ours_top, hta_top = culprits[:1], hta_answer[:1]
    print(
        f"CommInsight: culprits {culprits}, estimated slowdown x{slowdown['ratio']:.3f}, "
        f"median {statistics.median(ours_times):.3f} s; HTA: answer {hta_answer}, median "
        f"{statistics.median(hta_times):.3f} s"
    )
    print(
        f"time ratio HTA / CommInsight, end to end: median x{statistics.median(ratios):.1f} over {rounds} rounds "
        f"(min x{min(ratios):.1f}, max x{max(ratios):.1f}; target >= 10x); in CPU seconds median "
        f"x{statistics.median(cpu_ratios):.1f} (min x{min(cpu_ratios):.1f}, max x{max(cpu_ratios):.1f})"
    )
    print(
        f"same culprit: {bool(ours_top) and ours_top == hta_top} | truth {truth} | CommInsight {ours_top} | "
        f"HTA {hta_top}"
    )
    return {
        "one process, wall": _spread(ratios),
        "one process, CPU": _spread(cpu_ratios),
        "culprits": f"{culprits} / HTA {hta_answer} / truth {truth}",
    }


_HTA_SCRIPT = (
    "import sys\n"
    "from hta.trace_analysis import TraceAnalysis\n"
    "print(TraceAnalysis(trace_dir=sys.argv[1]).get_potential_stragglers(num_candidates=1))\n"
)


def _user_environment(tree: Path | None = None) -> dict[str, str]:
    """This environment, less what makes a fresh interpreter slower than a user's: without bytecode
    caches (PYTHONDONTWRITEBYTECODE, set in some development shells) every module of the source tree
    would be compiled again in every run. With ``tree``: its CommInsight first on the module path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree / "agent"), str(tree / "inject"), env.get("PYTHONPATH", "")])
    return env


def checkout(rev: str, where: Path) -> Path:
    """The tree of commit ``rev`` of this repository, unpacked at ``where`` (run with this tree's Python)."""
    where.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev, "agent", "inject"], cwd=ROOT, check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive.stdout, check=True)
    return where


def _timed_process(argv: list[str], tree: Path | None = None) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the process and its children, stdout) of one fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=False, env=_user_environment(tree))
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise RuntimeError(f"{argv[:3]} failed: {done.stderr[-500:]}")
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return wall, cpu, done.stdout


def cold_report(trace_dir: Path, hta_dir: Path, rounds: int, baseline: Path | None = None) -> dict[str, str]:
    """Each tool as a user runs it, in a fresh interpreter per round (imports included), alternately:
    ``comminsight analyze stragglers DIR --format json`` against a three-line HTA script (and the same
    command of the ``baseline`` tree, when given). A first run of each is not counted (it writes any
    missing bytecode cache and reads the traces into the page cache)."""
    cli = [sys.executable, "-c", "from comminsight.cli import main; main()", "analyze", "stragglers"]
    ours_argv = [*cli, str(trace_dir), "--format", "json"]
    hta_argv = [sys.executable, "-c", _HTA_SCRIPT, str(hta_dir)]
    try:
        first_ours, first_hta = _timed_process(ours_argv), _timed_process(hta_argv)
    except RuntimeError as exc:
        print(f"fresh processes skipped: {exc}")
        return {}
    print(f"first fresh runs, not counted: CommInsight {first_ours[0]:.3f} s, HTA {first_hta[0]:.3f} s")
    if baseline is not None:
        _timed_process(ours_argv, baseline)
    ours_wall, ours_cpu, hta_wall, hta_cpu, old_cpu = [], [], [], [], []
    for round_ in range(rounds):
        if baseline is not None:
            _, cpu, out = _timed_process(ours_argv, baseline)
            old_cpu.append(cpu)
            print(f"cold round {round_ + 1}: baseline CLI CPU {cpu:.3f} s, culprits {json.loads(out)['culprits']}")
        wall, cpu, out = _timed_process(ours_argv)
        culprits = json.loads(out)["culprits"]
        theirs_wall, theirs_cpu, answer = _timed_process(hta_argv)
        ours_wall.append(wall)
        ours_cpu.append(cpu)
        hta_wall.append(theirs_wall)
        hta_cpu.append(theirs_cpu)
        print(
            f"cold round {round_ + 1}: CommInsight CLI {wall:.3f} s (CPU {cpu:.3f} s), culprits {culprits}; "
            f"HTA {theirs_wall:.3f} s (CPU {theirs_cpu:.3f} s), answer {answer.strip().splitlines()[-1]}; "
            f"load average {os.getloadavg()[0]:.1f}"
        )
    wall_ratios = [h / o for h, o in zip(hta_wall, ours_wall, strict=True)]
    cpu_ratios = [h / o for h, o in zip(hta_cpu, ours_cpu, strict=True)]
    print(
        f"cold, fresh processes: CommInsight median {statistics.median(ours_wall):.3f} s wall, "
        f"{statistics.median(ours_cpu):.3f} s CPU; HTA median {statistics.median(hta_wall):.3f} s wall, "
        f"{statistics.median(hta_cpu):.3f} s CPU; ratio median x{statistics.median(wall_ratios):.1f} wall "
        f"(min x{min(wall_ratios):.1f}, max x{max(wall_ratios):.1f}), x{statistics.median(cpu_ratios):.1f} CPU "
        f"(min x{min(cpu_ratios):.1f}, max x{max(cpu_ratios):.1f})"
    )
    summary = {}
    if old_cpu:
        old_new = [o / n for o, n in zip(old_cpu, ours_cpu, strict=True)]
        summary["fresh CPU old / new"] = (
            f"{statistics.median(old_cpu):.3f} / {statistics.median(ours_cpu):.3f} s, "
            f"x{statistics.median(old_new):.2f} (x{min(old_new):.2f}-x{max(old_new):.2f})"
        )
        print(f"fresh processes, baseline / this tree, CPU: {summary['fresh CPU old / new']}")
    return summary | {
        "fresh, wall": _spread(wall_ratios),
        "fresh, CPU": _spread(cpu_ratios),
        "fresh CommInsight CPU s": f"{statistics.median(ours_cpu):.3f} ({min(ours_cpu):.3f}-{max(ours_cpu):.3f})",
        "fresh HTA CPU s": f"{statistics.median(hta_cpu):.3f} ({min(hta_cpu):.3f}-{max(hta_cpu):.3f})",
    }


# Generated sets by name: (steps, compute kernels per bucket); 8 ranks, rank 5 computes x1.3.
GENERATED = {"small": (20, 1), "medium": (20, 8), "large": (40, 24)}


def run_set(name: str, args: argparse.Namespace, tmp: Path) -> dict[str, str]:
    """One set of traces (``recorded`` or a generated one), both measures; the summary of its ratios."""
    trace_dir = tmp / name / "traces"
    trace_dir.mkdir(parents=True)
    if name == "recorded":
        size = copy_recorded(args.traces, trace_dir)
        meta_path = args.traces / "meta.json"
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        truth = meta.get("ground_truth", {}).get("slow_rank", "?")
        print(
            f"RECORDED Kineto traces ({args.traces}): {len(list(trace_dir.iterdir()))} ranks, "
            f"{size / 1e6:.2f} MB gzipped, {meta.get('versions', {})}; injected: "
            f"{meta.get('ground_truth', {}).get('injected', 'unknown')}"
        )
        hta_dir = tmp / name / "hta_compat"
        hta_dir.mkdir()
        copy_recorded(args.traces, hta_dir, rename_kernels=True)
        summary = report(trace_dir, f"[{truth}]", args.rounds, hta_dir)
        if args.cold_rounds:
            summary |= cold_report(trace_dir, hta_dir, args.cold_rounds, args.baseline_tree)
        return {"traces": f"recorded, {size / 1e6:.2f} MB gzip"} | summary
    steps, kernels = GENERATED.get(name, (args.steps, args.kernels))
    write_traces(trace_dir, args.ranks, steps, args.slow_rank, args.slow_factor, kernels)
    size = sum(p.stat().st_size for p in trace_dir.iterdir())
    print(
        f"SYNTHETIC Kineto traces (generated, not recorded on GPUs): {args.ranks} ranks x {steps} steps, "
        f"{kernels} compute kernel(s) per bucket, {size / 1e6:.1f} MB, known slow rank {args.slow_rank} "
        f"(x{args.slow_factor} compute)"
    )
    summary = report(trace_dir, f"[{args.slow_rank}]", args.rounds)
    if args.cold_rounds:
        summary |= cold_report(trace_dir, trace_dir, args.cold_rounds, args.baseline_tree)
    return {"traces": f"generated {name}, {size / 1e6:.1f} MB"} | summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", type=Path, default=RECORDED, help="folder of recorded per-rank traces")
    parser.add_argument("--synthetic", action="store_true", help="generate synthetic traces instead")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--slow-rank", type=int, default=5)
    parser.add_argument("--slow-factor", type=float, default=1.3)
    parser.add_argument("--kernels", type=int, default=1, help="compute kernels (each with its CPU op) per bucket")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of both tools")
    parser.add_argument(
        "--cold-rounds", type=int, default=0, help="also: alternating runs of each tool in a fresh process"
    )
    parser.add_argument("--sets", default="", help="comma-separated: recorded, small, medium, large")
    parser.add_argument(
        "--baseline", metavar="REV", help="fresh processes: also the command of this repository's commit REV (old code)"
    )
    args = parser.parse_args()
    args.baseline_tree = None
    print(f"load average {os.getloadavg()}, {os.cpu_count()} CPUs")
    if args.sets:
        names = [n.strip() for n in args.sets.split(",") if n.strip()]
        unknown = [n for n in names if n != "recorded" and n not in GENERATED]
        if unknown:
            parser.error(f"unknown set(s) {unknown}: recorded, {', '.join(GENERATED)}")
    else:
        recorded = not args.synthetic and args.traces.is_dir() and any(args.traces.glob("*.pt.trace.json.gz"))
        names = ["recorded" if recorded else "synthetic"]
    summaries = []
    with tempfile.TemporaryDirectory(prefix="ci-bench-kineto-") as tmp:
        if args.baseline:
            if not args.cold_rounds:
                parser.error("--baseline compares fresh processes: give --cold-rounds too")
            args.baseline_tree = checkout(args.baseline, Path(tmp) / "baseline")
            print(f"baseline: commit {args.baseline} (fresh processes only)")
        for name in names:
            print()
            summaries.append(run_set(name, args, Path(tmp)))
    print(f"\nsummary (HTA / CommInsight, median (min-max)); load average now {os.getloadavg()[0]:.1f}")
    for summary in summaries:
        print("  " + "; ".join(f"{key}: {value}" for key, value in summary.items()))


if __name__ == "__main__":
    main()
