"""Accuracy report: straggler attribution and step recovery on generated jobs with their own truth.

Every job comes from ``comminsight.simulator.tracegen`` (ByteDance trace format with compute rows,
read back through the table importer; Kineto JSON for the profiler case), so the true culprit and the
true slowdown are known: ``truth x`` is observed over the generator's ideal replay (every operation
at its nominal duration: the healthy ideal) and, in brackets, over the what-if study's ideal (every
operation at its mean over ranks and steps), which ``analyze stragglers`` reports as ``ratio``.
The public ByteDance sample is listed last against its ``blocking_slowdown``.

    .venv/bin/python bench/straggler_accuracy.py [--steps 5] [--seed 0] [--perf-steps 45]

``--perf-steps N`` also times one 128-rank, N-step trace with compute rows (analysis only).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import polars as pl

from comminsight.analysis.stragglers import analyse_stragglers
from comminsight.importers import load
from comminsight.simulator.tracegen import Fault, Layout, generate, write_kineto

PUBLIC = Path(__file__).resolve().parents[2] / "shared" / "data" / "public" / "bytedance_straggler"

JOBS = [
    ("64 TP4xPP4xDP4: DP group 1 compute x2", Layout(tp=4, pp=4, dp=4), (Fault("compute", {"dp": 1}, factor=2.0),)),
    (
        "128 DP32xPP2xCP2: stage 1 backward x1.4",
        Layout(pp=2, dp=32, cp=2),
        (Fault("compute", {"pp": 1}, factor=1.4, phase="backward"),),
    ),
    (
        "64 TP4xPP4xDP4: stage 2 backward x1.4",
        Layout(tp=4, pp=4, dp=4),
        (Fault("compute", {"pp": 2}, factor=1.4, phase="backward"),),
    ),
    (
        "16 TP2xPP2xDP4: one DP communicator x4",
        Layout(tp=2, pp=2, dp=4),
        (Fault("comm", {"pp": 1, "tp": 0}, factor=4.0, group="dp"),),
    ),
    (
        "16 TP2xPP2xDP4: P2P of one pipeline x30",
        Layout(tp=2, pp=2, dp=4),
        (Fault("comm", {"dp": 2, "tp": 1}, factor=30.0, group="pp"),),
    ),
    (
        "8 TP2xPP2xDP2: rank 1 late 2.5 ms before TP all-reduce",
        Layout(tp=2, pp=2, dp=2),
        (Fault("late", {"rank": 1}, delay_ms=2.5, before="tp-all-reduce"),),
    ),
    ("16 TP2xPP2xDP4: no straggler, 5% noise", Layout(tp=2, pp=2, dp=4), ()),
]


def row(name: str, truth: dict, report, seconds: float) -> None:
    sd = report.slowdown
    mean_truth = truth.get("slowdown_vs_mean")
    print(
        f"{name:58s} truth x{truth['slowdown']:.3f}"
        + (f" (x{mean_truth:.3f})" if mean_truth else "         ")
        + f"  est x{sd['healthy_ratio']:.3f} (x{sd['ratio']:.3f})"
        + f"  culprits true {truth['culprits'][:6]}{'…' if len(truth['culprits']) > 6 else ''}"
        + f" found {[g['group'] for g in report.culprit_groups]} {sorted(report.culprits) == truth['culprits']}"
        + f"  {seconds:.2f}s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--perf-steps", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name, layout, faults in JOBS:
            noise = 0.05 if not faults else 0.02
            job = generate(layout, steps=args.steps, faults=faults, noise=noise, seed=args.seed)
            table = pl.from_arrow(load(job.write(Path(tmp) / "trace.parquet")))
            t0 = time.perf_counter()
            report = analyse_stragglers(table)
            row(name, job.truth, report, time.perf_counter() - t0)
        truth = write_kineto(Path(tmp) / "kineto", ranks=8, steps=8, slow_rank=5, sleep_ms=40.0, seed=args.seed)
        t0 = time.perf_counter()
        report = analyse_stragglers(load(Path(tmp) / "kineto"))
        row("Kineto 8 ranks: rank 5 sleeps 40 ms before backward", truth, report, time.perf_counter() - t0)
        if (PUBLIC / "trace-ST.parquet").is_file():
            result = json.loads((PUBLIC / "result-ST.json").read_text())
            by_stage = result["blocking_decompose_by_stage"]
            t0 = time.perf_counter()
            report = analyse_stragglers(load(PUBLIC / "trace-ST.parquet"))
            name = "public ByteDance 8-GPU sample (measured, not generated)"
            print(
                f"{name:58s} measured x{result['blocking_slowdown']:.3f}"
                f"  est x{report.slowdown['ratio']:.3f}  blamed stage {max(by_stage, key=by_stage.get)}"
                f" found {[g['group'] for g in report.culprit_groups]}  {time.perf_counter() - t0:.2f}s"
            )
        if args.perf_steps:
            job = generate(Layout(pp=2, dp=32, cp=2), steps=args.perf_steps, seed=args.seed)
            table = pl.from_arrow(load(job.write(Path(tmp) / "perf.parquet")))
            t0 = time.perf_counter()
            analyse_stragglers(table)
            print(f"128 ranks x {args.perf_steps} steps, {table.height} rows: {time.perf_counter() - t0:.2f}s")


if __name__ == "__main__":
    main()
