"""Accuracy matrix: every fault kind of issue 16 on every generated layout, against the generator's truth.

Layouts (``comminsight.simulator.tracegen``, ByteDance format with compute rows, read back through
the table importer): 8 GPUs TP2xPP2xDP2, 64 GPUs TP4xPP4xDP4, 64 GPUs DP8xPP8 (8 micro-batches),
128 GPUs DP32xPP2xCP2 and 128 GPUs TP2xPP4xDP16. Faults: one DP group's compute x2; the last
stage's backward x1.4; the first stage's backward x1.4; one data-parallel communicator's transfers
x4 (a slow link); rank 1 late by 3% of the ideal step before its TP all-reduce (before its backward
when there is no TP); and a job with 5% noise and no straggler. 5 steps, 2% noise.

A row is ``OK`` when the culprits are exactly the generator's faulty ranks whose fault costs the job
time, both ratios are within 10% of the truth (healthy ratio against the nominal ideal, ``ratio`` in
brackets against the what-if study's mean ideal), and no subset's ratio is below 1. A fault's cost is
the generator's own: the job's step time with the fault minus the same job (same seed, same noise
draws) without it. A fault costing less than the analysis' resolution (``min_gain``, 0.5% of the
step) must name no one: a late rank whose delay a pipeline bubble absorbs slows nothing.

    .venv/bin/python bench/straggler_matrix.py [--seeds 0 1] [--sizes 8 64 128 128b 64c]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import polars as pl

from comminsight.analysis.stragglers import analyse_stragglers
from comminsight.importers import load
from comminsight.simulator.tracegen import Fault, Layout, generate

MIN_GAIN = 0.005  # the analysis' default resolution, a share of the step

LAYOUTS = {
    "8": Layout(tp=2, pp=2, dp=2),
    "64": Layout(tp=4, pp=4, dp=4),
    "64c": Layout(pp=8, dp=8, microbatches=8),
    "128": Layout(pp=2, dp=32, cp=2),
    "128b": Layout(tp=2, pp=4, dp=16),
}


def faults(layout: Layout) -> dict[str, tuple[Fault, ...]]:
    ideal_ms = generate(layout, steps=2, noise=0.0).truth["ideal_step_s"] * 1e3
    before = "tp-all-reduce" if layout.tp > 1 else "backward-compute"
    return {
        "DP group 1 compute x2": (Fault("compute", {"dp": 1}, factor=2.0),),
        "last stage backward x1.4": (Fault("compute", {"pp": layout.pp - 1}, factor=1.4, phase="backward"),),
        "first stage backward x1.4": (Fault("compute", {"pp": 0}, factor=1.4, phase="backward"),),
        "one DP link x4": (Fault("comm", {"pp": 0, "tp": 0}, factor=4.0, group="dp"),),
        "rank 1 late 3%": (Fault("late", {"rank": 1}, delay_ms=0.03 * ideal_ms, before=before),),
        "no straggler, 5% noise": (),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--sizes", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            layout = LAYOUTS[size]
            for name, fs in faults(layout).items():
                for seed in args.seeds:
                    noise = 0.05 if not fs else 0.02
                    job = generate(layout, steps=5, faults=fs, noise=noise, seed=seed)
                    clean = generate(layout, steps=5, noise=noise, seed=seed).truth if fs else job.truth
                    cost = job.truth["observed_step_s"] - clean["observed_step_s"]
                    costs = cost >= MIN_GAIN * clean["observed_step_s"]
                    expected = job.truth["culprits"] if costs else []
                    table = pl.from_arrow(load(job.write(Path(tmp) / "trace.parquet")))
                    t0 = time.perf_counter()
                    report = analyse_stragglers(table, min_gain=MIN_GAIN)
                    seconds = time.perf_counter() - t0
                    sd, truth = report.slowdown, job.truth
                    below_one = [
                        (kind, e["subset"])
                        for kind, entries in report.attribution.items()
                        for e in entries
                        if e["slowdown_ratio"] < 1 - 1e-9 or e.get("gain_without", 1.0) < 1 - 1e-9
                    ]
                    err = sd["ratio"] / truth["slowdown_vs_mean"] - 1
                    healthy_err = sd["healthy_ratio"] / truth["slowdown"] - 1
                    exact = sorted(report.culprits) == expected
                    ok = exact and abs(err) <= 0.1 and abs(healthy_err) <= 0.1 and not below_one
                    print(
                        f"{'OK ' if ok else 'BAD'} {size:>4} {name:26s} seed {seed}"
                        f"  truth x{truth['slowdown']:.3f} (x{truth['slowdown_vs_mean']:.3f})"
                        f"  est x{sd['healthy_ratio']:.3f} (x{sd['ratio']:.3f})  err {healthy_err:+.2f} ({err:+.2f})"
                        f"  fault costs {cost * 1e3:.2f} ms/step"
                        f"  found {[g['group'] for g in report.culprit_groups]}"
                        f" {[round(g['saves_ms_per_step'], 2) for g in report.culprit_groups]} ms  {seconds:.1f}s",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
