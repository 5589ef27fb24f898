"""Benchmark: semantic engine (step recovery) throughput per core and memory against steps.

Baseline, measured in the same run: a plain Python per-event state machine doing the same job
(classify each event, open a step at a start token after an end token, count per step).

Events: a Megatron-style TP x PP x DP job from the seeded test generator (tests/semantic/
synthetic.py), tiled in time to the requested number of steps, so the signature sequence is the
real one. Target (DESIGN.md section 9): >= 10 M events/s per core offline; memory flat in steps.

    .venv/bin/python bench/semantic.py [--events 8000000]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "semantic"))
import synthetic

from comminsight.semantic import StepEngine, builtin_templates, prepare_events
from comminsight.semantic.roles import ROLES
from comminsight.semantic.templates import END, NEUTRAL, START


def tiled_events(n_events: int) -> dict[str, np.ndarray]:
    """Per-rank event arrays of about ``n_events`` in total, sorted by (rank, start)."""
    base = prepare_events(pl.from_arrow(synthetic.table("megatron", steps=4, seed=0)))
    ranks = np.unique(base["rank"])
    per_rank = max(1, n_events // ranks.size)
    out: dict[str, list[np.ndarray]] = {k: [] for k in base}
    for r in ranks:
        m = base["rank"] == r
        sig = base["sig"][m]
        # One step's worth of this rank's events (steps 1..3 are steady-state), repeated.
        span = int(base["end_ns"][m].max() - base["start_ns"][m].min())
        reps = per_rank // sig.size + 1
        idx = np.tile(np.arange(sig.size), reps)[:per_rank]
        shift = np.repeat(np.arange(reps, dtype=np.int64) * span, sig.size)[:per_rank]
        for key in base:
            col = base[key][m][idx]
            if key in ("start_ns", "end_ns"):
                col = col + shift
            out[key].append(col)
    events = {k: np.concatenate(v) for k, v in out.items()}
    events["row"] = np.arange(events["rank"].size)
    return events


def naive(events: dict[str, np.ndarray], cls_table: np.ndarray, n_roles: int) -> int:
    """Pure-Python baseline: one loop iteration per event, same output (per-step summaries)."""
    cls_list = cls_table.tolist()
    summaries = []
    rank_prev, after_end, cur = None, True, None
    columns = (events[k].tolist() for k in ("rank", "sig", "role", "start_ns", "end_ns", "wait_ns"))
    for rank, sig, role, start, end, wait in zip(*columns, strict=True):
        if rank != rank_prev:
            rank_prev, after_end, cur = rank, True, None
        c = cls_list[sig]
        if c == START and after_end:
            cur = [rank, start, end, 0, 0, [0] * n_roles]
            summaries.append(cur)
        if c != NEUTRAL:
            after_end = c == END
        if cur is not None:
            cur[2] = max(cur[2], end)
            cur[3] += 1
            cur[4] += wait
            cur[5][role] += end - start
    return len(summaries)


def throughput(n_events: int) -> None:
    events = tiled_events(n_events)
    n = events["rank"].size
    template = next(t for t in builtin_templates() if t.name == "megatron")
    cls_table = template.tables()[0]
    engine = StepEngine(templates=[template])
    t0 = time.process_time()
    chunk = 1 << 20
    steps = 0
    for lo in range(0, n, chunk):
        steps += sum(len(b["step"]) for b in engine.feed({k: v[lo : lo + chunk] for k, v in events.items()})["final"])
    steps += sum(len(b["step"]) for b in engine.flush()["final"])
    engine_s = time.process_time() - t0
    sample = {k: v[: min(n, 2_000_000)] for k, v in events.items()}
    t0 = time.process_time()
    naive(sample, cls_table, len(ROLES))
    naive_s = (time.process_time() - t0) * n / sample["rank"].size
    print(f"events: {n:,} over {np.unique(events['rank']).size} ranks, {steps:,} rank-steps")
    print(f"engine (numpy, chunks of {chunk:,}): {n / engine_s / 1e6:7.1f} M events/s per core (CPU time)")
    print(f"naive per-event Python loop:        {n / naive_s / 1e6:7.1f} M events/s per core (extrapolated from 2M)")
    print(
        f"ratio engine / naive: {naive_s / engine_s:.1f}x   "
        f"target >= 10 M events/s: {'met' if n / engine_s >= 10e6 else 'NOT met'}"
    )


def end_to_end(n_rows: int) -> None:
    """recover_steps on an operations table: preparing signatures from Arrow columns included."""
    from comminsight.semantic import recover_steps

    base = pl.from_arrow(synthetic.table("megatron", steps=4, seed=0))
    span = int(base.get_column("end_ns").max() - base.get_column("start_ns").min())
    reps = max(1, n_rows // base.height)
    table = pl.concat(
        [
            base.with_columns(
                pl.col("start_ns") + i * span, pl.col("end_ns") + i * span, seq=pl.col("seq") + i * 10_000
            )
            for i in range(reps)
        ]
    ).with_columns(step=pl.lit(None, dtype=pl.Int64))
    t0 = time.process_time()
    report = recover_steps(table)
    cpu = time.process_time() - t0
    print(
        f"\nend to end (operations table -> steps, {table.height:,} rows, method {report.method}): "
        f"{table.height / cpu / 1e6:.1f} M rows/s per core (CPU time)"
    )


def memory_against_steps() -> None:
    print("\npeak traced memory while streaming (chunks of 65,536 events; input arrays excluded):")
    for n_events in (200_000, 1_000_000, 4_000_000):
        events = tiled_events(n_events)
        engine = StepEngine()
        tracemalloc.start()
        steps = 0
        for lo in range(0, events["rank"].size, 65_536):
            steps += sum(
                len(b["step"]) for b in engine.feed({k: v[lo : lo + 65_536] for k, v in events.items()})["final"]
            )
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        print(
            f"  {steps:>8,} rank-steps: peak {peak / 1e6:6.2f} MB, checkpoint {len(engine.checkpoint()) / 1e3:6.1f} kB"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=8_000_000)
    args = parser.parse_args()
    print(f"semantic engine benchmark (pid {os.getpid()}, 1 process)")
    throughput(args.events)
    end_to_end(args.events // 4)
    memory_against_steps()


if __name__ == "__main__":
    main()
