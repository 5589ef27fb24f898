"""Benchmark: hang analysis on a synthetic 16,384-rank evidence set, against a naive per-group loop.

Two evidence sets, both with one hung rank that never entered the last collective of one
communicator while every other rank waits inside it:

* ``8 comms x 16,384``: 8 communicators each spanning all 16,384 ranks (the brief's set);
* ``8 layers``: a Megatron-like layout where every rank is in 8 communicators of different sizes
  (world, TP 8, PP 4, DP 512, EP 64, CP 2, TP-DP 16, embedding 128): thousands of communicators.

Each rank carries a window of W recent operations per communicator (completed, then one in
flight), with timing, as this project's raw logs would. The baseline is the obvious Python: per
communicator, per member, scan its rows for the highest entered and completed sequence, then
find the lowest sequence not completed by all and who never entered it. Both run in this
process on the same table; the ratio is baseline / comminsight in CPU seconds (every thread of this
process), which a busy shared machine disturbs less than wall time. Peak memory is the growth of
resident memory during a first analysis in a fresh process (the evidence table itself is not counted).

With ``--against REV`` (a git revision, e.g. ``HEAD~1``), the analysis at that revision runs too:
its package is taken from git into a temporary directory, and each round times it and this code in
fresh processes, alternately, on the same generated table; the reports must be equal as JSON, and
the table shows this code's CPU time, wall time and peak memory as ratios against it.

Run: .venv/bin/python bench/hang_analysis.py [--window 16] [--repeat 3] [--against HEAD~1 --rounds 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
from rich.console import Console
from rich.table import Table

from comminsight.analysis import analyze_hang
from comminsight.evidence import conform

WORLD = 16_384


def evidence(layer_sizes: list[int], window: int, hung: int, seed: int = 0) -> pa.Table:
    """Operations table: every rank, every layer, ``window`` ops; ``hung`` skips the last op of layer 0."""
    rng = np.random.default_rng(seed)
    ranks = np.arange(WORLD, dtype=np.int32)
    parts = []
    for layer, size in enumerate(layer_sizes):
        group = ranks // size if layer % 2 == 0 else ranks % (WORLD // size)  # alternate contiguous/strided
        comm = np.char.add(f"L{layer}.", group.astype(str))
        base = int(rng.integers(1_000, 100_000))
        seq = base + np.arange(window, dtype=np.int64)
        n = WORLD * window
        rank_col = np.repeat(ranks, window)
        seq_col = np.tile(seq, WORLD)
        last = seq_col == seq[-1]
        keep = ~((rank_col == hung) & last) if layer == 0 else np.ones(n, bool)
        t0 = 1_700_000_000_000_000_000 + (seq_col - base) * 1_000_000 + rng.integers(0, 1000, n)
        state = np.where(last, "started", "completed")
        parts.append(
            pa.table(
                {
                    "rank": pa.array(rank_col[keep]),
                    "comm_id": pa.array(np.repeat(comm, window)[keep]),
                    "comm_desc": pa.array(np.full(keep.sum(), f"LAYER_{layer}_GROUP")),
                    "comm_size": pa.array(np.full(keep.sum(), size, np.int32)),
                    "op": pa.array(np.full(keep.sum(), "all_reduce")),
                    "is_p2p": pa.array(np.zeros(keep.sum(), bool)),
                    "seq": pa.array(seq_col[keep]),
                    "seq_kind": pa.array(np.full(keep.sum(), "comm")),
                    "count": pa.array(np.full(keep.sum(), 1 << 20, np.int64)),
                    "dtype": pa.array(np.full(keep.sum(), "bfloat16")),
                    "state": pa.array(state[keep]),
                    "enqueue_ns": pa.array(t0[keep]),
                    "start_ns": pa.array(t0[keep] + 10_000),
                    "end_ns": pa.array(np.where(last, 0, t0 + 500_000)[keep]),
                    "source": pa.array(np.full(keep.sum(), "bench")),
                }
            )
        )
    table = pa.concat_tables(parts)
    end = table.column("end_ns")
    table = table.set_column(
        table.schema.get_field_index("end_ns"),
        "end_ns",
        pa.compute.if_else(pa.compute.equal(end, 0), pa.scalar(None, pa.int64()), end),
    )
    return conform(table)


def naive(table: pa.Table) -> tuple[list[int], list[tuple]]:
    """Baseline: per communicator, per member, a Python scan of its rows."""
    rows = zip(
        table.column("comm_id").to_pylist(),
        table.column("rank").to_pylist(),
        table.column("seq").to_pylist(),
        table.column("state").to_pylist(),
        strict=True,
    )
    per_comm: dict[str, dict[int, list[tuple[int, str]]]] = defaultdict(lambda: defaultdict(list))
    for comm, rank, seq, state in rows:
        per_comm[comm][rank].append((seq, state))
    stuck, roots = [], set()
    for comm, members in per_comm.items():
        entered = {r: max(s for s, _ in ops) for r, ops in members.items()}
        completed = {r: max((s for s, st in ops if st == "completed"), default=-1) for r, ops in members.items()}
        lowest = min(completed.values()) + 1
        if lowest > max(entered.values()):
            continue
        blocking = min(entered.values()) + 1
        seq = blocking if blocking <= max(entered.values()) else lowest
        missing = sorted(r for r, e in entered.items() if e < seq)
        stuck.append((comm, seq, missing))
        roots.update(missing)
    return sorted(roots), stuck


class _PeakRSS:
    """Highest resident memory of this process while the block runs, above what it was at the start.

    Sampled every millisecond from /proc (polars and Arrow allocate outside Python's tracemalloc).
    """

    def __enter__(self) -> _PeakRSS:
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def grown(self) -> int:
        return self.peak - self.start


def _rss() -> int:
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * _PAGE


_PAGE = os.sysconf("SC_PAGE_SIZE")


def timed(fn, repeat: int):
    """(best wall seconds, best CPU seconds of this process - every thread -, peak memory growth, result)."""
    best_wall = best_cpu = float("inf")
    peak, result = 0, None
    for _ in range(repeat):
        with _PeakRSS() as rss:
            t0, c0 = time.perf_counter(), time.process_time()
            result = fn()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        best_wall, best_cpu, peak = min(best_wall, wall), min(best_cpu, cpu), max(peak, rss.grown)
    return best_wall, best_cpu, peak, result


SETS = {
    "8 comms x 16,384 ranks": [WORLD] * 8,
    "8 layers (Megatron-like)": [WORLD, 8, 4, 512, 64, 2, 16, 128],
}


def _peak_in_child(name: str, window: int, hung: int) -> int:
    """Memory growth of a first analysis in a fresh process (allocators keep their pages for later
    calls, so only a first call shows the peak)."""
    done = subprocess.run(
        [sys.executable, __file__, "--peak-of", name, "--window", str(window), "--hung", str(hung)],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(done.stdout.split()[-1])


def _time_in_child(name: str, window: int, hung: int, repeat: int, package: str | None) -> dict:
    """Best CPU and wall seconds of ``repeat`` analyses in a fresh process (after one untimed), its
    first analysis's memory growth and a digest of the report; ``package`` puts another revision's
    ``comminsight`` first on the path."""
    env = dict(os.environ)
    if package:
        env["PYTHONPATH"] = package + os.pathsep + env.get("PYTHONPATH", "")
    command = [sys.executable, __file__, "--time-of", name, "--window", str(window), "--hung", str(hung)]
    done = subprocess.run(
        [*command, "--repeat", str(repeat)], capture_output=True, text=True, check=True, env=env, cwd="/"
    )
    return json.loads(done.stdout.splitlines()[-1])


def _time_of(name: str, window: int, hung: int, repeat: int) -> None:
    import comminsight

    data = evidence(SETS[name], window, hung)
    with _PeakRSS() as rss:
        report = analyze_hang(data)
    wall, cpu, _, again = timed(lambda: analyze_hang(data), repeat)
    text = json.dumps(report, sort_keys=True).encode()
    assert json.dumps(again, sort_keys=True).encode() == text
    result = {
        "wall": wall,
        "cpu": cpu,
        "peak": rss.grown,
        "digest": hashlib.sha256(text).hexdigest(),
        "package": str(Path(comminsight.__file__).parent),
    }
    print(json.dumps(result))


def _against(revision: str, window: int, hung: int, repeat: int, rounds: int) -> None:
    """This code against ``revision``'s, alternately in fresh processes, on the same tables."""
    root = Path(__file__).resolve().parents[1]
    console = Console(width=140)
    out = Table(
        title=f"Hang analysis, {WORLD:,} ranks: this code against {revision} "
        f"(fresh processes, alternating, {rounds} rounds, best of {repeat} per process)"
    )
    for column in (
        "evidence set",
        "CPU s",
        "prev CPU s",
        "CPU ratio",
        "wall s",
        "prev wall s",
        "wall ratio",
        "peak MiB",
        "prev peak MiB",
        "reports",
    ):
        out.add_column(column, justify="right")
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "-C", str(root), "archive", revision, "agent/comminsight"], capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        package = str(Path(tmp) / "agent")
        for name in SETS:
            ours, prev = [], []
            for _ in range(rounds):
                ours.append(_time_in_child(name, window, hung, repeat, None))
                prev.append(_time_in_child(name, window, hung, repeat, package))
            assert all(p["package"].startswith(tmp) for p in prev), "the previous revision was not the one loaded"
            same = {r["digest"] for r in ours + prev}
            ratio = {
                k: statistics.median(p[k] / o[k] for o, p in zip(ours, prev, strict=True))
                for k in ("cpu", "wall", "peak")
            }
            best = {k: min(o[k] for o in ours) for k in ("cpu", "wall")}
            pbest = {k: min(p[k] for p in prev) for k in ("cpu", "wall")}
            out.add_row(
                name,
                f"{best['cpu']:.3f}",
                f"{pbest['cpu']:.3f}",
                f"{ratio['cpu']:.2f}x less",
                f"{best['wall']:.3f}",
                f"{pbest['wall']:.3f}",
                f"{ratio['wall']:.2f}x less",
                f"{statistics.median(o['peak'] for o in ours) / 2**20:,.0f}",
                f"{statistics.median(p['peak'] for p in prev) / 2**20:,.0f}",
                "identical" if len(same) == 1 else "DIFFERENT",
            )
    console.print(out)
    console.print(
        "ratios: median over rounds of previous / this code (CPU, wall, peak memory growth of a first analysis)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=16, help="operations per rank per communicator")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--peak-of", help=argparse.SUPPRESS)
    parser.add_argument("--hung", type=int, default=9_999, help=argparse.SUPPRESS)
    parser.add_argument("--time-of", help=argparse.SUPPRESS)
    parser.add_argument("--against", metavar="REV", help="also run the analysis at this git revision, alternately")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds with --against")
    args = parser.parse_args()
    hung = args.hung
    if args.time_of:
        _time_of(args.time_of, args.window, hung, args.repeat)
        return
    if args.against:
        _against(args.against, args.window, hung, args.repeat, args.rounds)
        return
    if args.peak_of:
        data = evidence(SETS[args.peak_of], args.window, hung)
        with _PeakRSS() as rss:
            analyze_hang(data)
        print(rss.grown)
        return
    console = Console(width=140)
    sets = SETS
    table_out = Table(
        title=f"Hang analysis, {WORLD:,} ranks, window {args.window} ops/rank/comm (best of {args.repeat})"
    )
    for column in (
        "evidence set",
        "rows",
        "comms",
        "comminsight wall s",
        "CPU s",
        "peak MiB",
        "naive wall s",
        "CPU s ",
        "speed-up (CPU)",
        "answer",
    ):
        table_out.add_column(column, justify="right")
    for name, layers in sets.items():
        data = evidence(layers, args.window, hung)
        comms = pa.compute.count_distinct(data.column("comm_id")).as_py()
        ours_peak = _peak_in_child(name, args.window, hung)
        analyze_hang(data)  # first-use costs (imports, polars' thread pool) are not the analysis
        ours_s, ours_cpu, _, report = timed(lambda data=data: analyze_hang(data), args.repeat)
        naive_s, naive_cpu, _, (naive_roots, _) = timed(lambda data=data: naive(data), 1)
        ok = report["root_cause_ranks"] == [hung] and naive_roots == [hung]
        table_out.add_row(
            name,
            f"{data.num_rows:,}",
            f"{comms:,}",
            f"{ours_s:.3f}",
            f"{ours_cpu:.3f}",
            f"{ours_peak / 2**20:,.0f}",
            f"{naive_s:.3f}",
            f"{naive_cpu:.3f}",
            f"{naive_cpu / ours_cpu:.1f}x",
            "root cause found" if ok else f"WRONG {report['root_cause_ranks'][:4]}",
        )
    console.print(table_out)
    console.print("target: <= 1 s for 16,384 ranks (docs/analysis-hang.md)")


if __name__ == "__main__":
    main()
