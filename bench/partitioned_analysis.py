"""Partitioned vs whole-table analyses (hang, perf) on a large synthetic store: time and peak memory per task.

Writes a synthetic job into a store laid out as the site keeps it (``store/node-<n>/rank-<r>/s.parquet``):
``--ranks`` ranks, 8 per node, each doing ``--ops`` collectives alternating between the world
communicator and its tensor-parallel group of 8 (sizes 1 KiB-64 MiB); rank 7 stops before its last
world all-reduce (a hang). Then, in the same run:

  - whole:       one process reads every file and runs the analysis (what a single job task did);
  - partitioned: one map task per partition the site would plan (hang: whole ranks up to
                 ``--partition-rows`` rows; perf: whole communicators up to that many rows, read with a
                 ``comm_id`` filter from their members' files), then the reduce; with 1 and 2 workers.

Tasks run in long-lived worker processes, as Celery's are (started and warmed up - libraries imported -
before the clock starts); a worker's peak RSS over the tasks it ran bounds each of its tasks' peaks, the
imported libraries included (~130 MiB). Checks that both ways give the same report, then prints times,
peak RSS and the ratios.

Run: .venv/bin/python bench/partitioned_analysis.py [--ranks 256] [--ops 8192] [--partition-rows 500000]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from comminsight.evidence import conform
from comminsight.evidence.schema import SCHEMA

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.analysis_partitioned.compare
PERF_COLUMNS = ["rank", "comm_id", "comm_size", "op", "is_p2p", "seq", "peer", "bytes", "start_ns", "end_ns"]
PERF_COLUMNS += ["enqueue_ns"]
STUCK_RANK = 7
TP = 8


def rank_table(rank: int, ranks: int, ops: int) -> pa.Table:
    """One rank's operations: world and TP all-reduces alternating, one per ~100 us (vectorised)."""
    rng = np.random.default_rng(rank)
    i = np.arange(ops)
    world = i % 2 == 0
    seq = i // 2
    group = rank // TP
    size_exp = 10 + (seq % 17)  # 1 KiB .. 64 MiB
    nbytes = (1 << size_exp).astype(np.int64)
    start = 1_700_000_000_000_000_000 + i * 100_000 + rng.integers(0, 5_000, ops)
    end = start + 20_000 + nbytes // 50
    state = np.full(ops, "completed", dtype=object)
    if rank == STUCK_RANK:  # stops before its last world all-reduce; its TP peers and the world wait
        keep = ~(world & (seq == seq[world].max()))
        i, world, seq, nbytes, start, end, state = (a[keep] for a in (i, world, seq, nbytes, start, end, state))
    else:
        last_world = world & (seq == seq[world].max())
        state[last_world] = "started"
        end = np.where(last_world, 0, end)
    n = len(i)
    return conform(
        pa.table(
            {
                "workload": ["bench"] * n,
                "node": [f"node-{rank // 8}"] * n,
                "rank": np.full(n, rank, np.int32),
                "comm_id": np.where(world, "world", f"tp-{group}"),
                "comm_size": np.where(world, ranks, TP).astype(np.int32),
                "op": ["all_reduce"] * n,
                "is_p2p": np.zeros(n, bool),
                "seq": seq.astype(np.int64),
                "seq_kind": ["comm"] * n,
                "count": nbytes // 2,
                "bytes": nbytes,
                "dtype": ["bfloat16"] * n,
                "state": state.tolist(),
                "enqueue_ns": start - 1_000,
                "start_ns": start,
                "end_ns": pa.array(end, mask=end == 0),
                "source": ["bench"] * n,
            }
        )
    )


def write_store(root: Path, ranks: int, ops: int) -> list[str]:
    files = []
    for rank in range(ranks):
        path = root / f"node-{rank // 8:05d}" / f"rank-{rank:06d}" / "s.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(rank_table(rank, ranks, ops), path, compression="zstd")
        files.append(str(path))
    return sorted(files)


# --- tasks (each in a fresh process) ---------------------------------------------------------------------------


def _warm() -> None:
    import comminsight.analysis.partitioned  # noqa: F401  (libraries imported before the clock starts)


def _settle(seconds: float) -> int:
    time.sleep(seconds)  # keeps one worker busy so the next warm-up lands on another
    return 0


def warm_pool(workers: int) -> ProcessPoolExecutor:
    pool = ProcessPoolExecutor(max_workers=workers, initializer=_warm)
    list(pool.map(_settle, [0.5] * workers))
    return pool


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _timed(work: Callable[[], Any]) -> tuple[Any, float, float]:
    t0 = time.perf_counter()
    out = work()
    return out, time.perf_counter() - t0, _peak_mib()


def whole_task(kind: str, files: list[str]) -> tuple[str, float, float]:
    def work() -> str:
        from comminsight.analysis.hang import analyze_hang
        from comminsight.analysis.perf import analyse_perf

        table = ds.dataset(files, format="parquet", schema=SCHEMA).to_table()
        report = analyze_hang(table) if kind == "hang" else analyse_perf(table)
        return json.dumps(report, default=str)

    return _timed(work)


def map_task(kind: str, files: list[str], comm_ids: list[str] | None, out: str) -> tuple[None, float, float]:
    def work() -> None:
        from comminsight.analysis.partitioned import hang_tail, perf_map

        dataset = ds.dataset(files, format="parquet", schema=SCHEMA)
        if kind == "hang":
            hang_tail(dataset.to_table()).write_parquet(f"{out}-tail.parquet")
            return
        where = pc.field("comm_id").isin(comm_ids)
        summary = perf_map(dataset.to_table(columns=PERF_COLUMNS, filter=where))
        if summary is not None:
            summary[0].write_parquet(f"{out}-groups.parquet")
            summary[1].write_parquet(f"{out}-samples.parquet")

    return _timed(work)


def reduce_task(kind: str, outs: list[str]) -> tuple[str, float, float]:
    def work() -> str:
        from comminsight.analysis.partitioned import hang_reduce, perf_reduce_by_rank

        if kind == "hang":
            report = hang_reduce(pl.read_parquet(f"{o}-tail.parquet") for o in outs)
        else:  # as the site merges: the samples a range of ranks at a time (64 ranks here)
            done = [o for o in outs if Path(f"{o}-groups.parquet").exists()]
            samples = pl.scan_parquet([f"{o}-samples.parquet" for o in done])
            high = samples.select(pl.col("rank").max()).collect().item()
            chunks = (
                samples.filter((pl.col("rank") >= lo) & (pl.col("rank") < lo + 64)).collect()
                for lo in range(0, high + 1, 64)
            )
            report = perf_reduce_by_rank([pl.read_parquet(f"{o}-groups.parquet") for o in done], chunks)
        return json.dumps(report, default=str)

    return _timed(work)


# --- planning (as apps.analysis.partitions does it) ------------------------------------------------------------


def plan(kind: str, files: list[str], max_rows: int) -> list[tuple[list[str], list[str] | None]]:
    if kind == "hang":
        parts: list[tuple[list[str], list[str] | None]] = []
        current: list[str] = []
        rows = 0
        for location in files:  # one file per rank here
            n = pq.ParquetFile(location).metadata.num_rows
            if current and rows + n > max_rows:
                parts.append((current, None))
                current, rows = [], 0
            current.append(location)
            rows += n
        return [*parts, (current, None)] if current else parts
    counts: dict[str, int] = {}
    holders: dict[str, set[int]] = {}
    for index, location in enumerate(files):  # which files hold each communicator's rows
        values = pc.value_counts(pq.read_table(location, columns=["comm_id"]).column(0))
        for value, count in zip(values.field(0).to_pylist(), values.field(1).to_pylist(), strict=True):
            counts[value] = counts.get(value, 0) + count
            holders.setdefault(value, set()).add(index)
    groups: list[list[str]] = []
    current_comms: list[str] = []
    rows = 0
    for comm in sorted(counts):
        if current_comms and rows + counts[comm] > max_rows:
            groups.append(current_comms)
            current_comms, rows = [], 0
        current_comms.append(comm)
        rows += counts[comm]
    groups += [current_comms] if current_comms else []
    return [([files[i] for i in sorted(set().union(*(holders[c] for c in g)))], g) for g in groups]


def run_partitioned(kind: str, files: list[str], max_rows: int, workers: int, scratch: Path) -> dict[str, Any]:
    with warm_pool(workers) as pool:
        t0 = time.perf_counter()
        parts = plan(kind, files, max_rows)
        t_plan = time.perf_counter() - t0
        outs = [str(scratch / f"{kind}-{workers}-{i:05d}") for i in range(len(parts))]
        maps = list(pool.map(map_task, [kind] * len(parts), [p[0] for p in parts], [p[1] for p in parts], outs))
        t_maps = time.perf_counter() - t0
        # the reduce in a worker of its own, so its peak is not the maps'
        with warm_pool(1) as reducer:
            t1 = time.perf_counter()
            report, t_reduce, peak_reduce = reducer.submit(reduce_task, kind, outs).result()
            t_reduce = time.perf_counter() - t1
    return {
        "report": report,
        "wall_s": t_maps + t_reduce,
        "plan_s": t_plan,
        "partitions": len(parts),
        "map_s_max": max(m[1] for m in maps),
        "map_peak_mib_max": max(m[2] for m in maps),
        "reduce_s": t_reduce,
        "reduce_peak_mib": peak_reduce,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--ops", type=int, default=8192, help="operations per rank")
    parser.add_argument("--partition-rows", type=int, default=500_000)
    parser.add_argument("--kinds", default="hang,perf")
    args = parser.parse_args()
    from tests.analysis_partitioned.compare import canonical, settled

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        files = write_store(root / "store", args.ranks, args.ops)
        rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
        store_mib = sum(Path(f).stat().st_size for f in files) / 2**20
        took = time.perf_counter() - t0
        print(f"store: {args.ranks} ranks, {rows:,} operations, {store_mib:.0f} MiB Parquet (written in {took:.0f} s)")
        for kind in args.kinds.split(","):
            with warm_pool(1) as pool:
                t1 = time.perf_counter()
                whole_report, _, whole_peak = pool.submit(whole_task, kind, files).result()
                whole_s = time.perf_counter() - t1
            same = settled if kind == "hang" else canonical
            runs = {w: run_partitioned(kind, files, args.partition_rows, w, root) for w in (1, 2)}
            for run in runs.values():
                assert same(json.loads(run["report"])) == same(json.loads(whole_report)), f"{kind}: reports differ"
            one, two = runs[1], runs[2]
            limit = f"{args.partition_rows:,}"
            print(f"\n{kind}: {one['partitions']} partitions of <= {limit} rows (plan {one['plan_s']:.1f} s)")
            print(f"  whole table, one task:   {whole_s:7.1f} s   peak {whole_peak:7.0f} MiB")
            map_peak, reduce_peak = one["map_peak_mib_max"], one["reduce_peak_mib"]
            print(
                f"  partitioned, 1 worker:   {one['wall_s']:7.1f} s   peak of a map worker {map_peak:6.0f} MiB"
                f" (slowest map {one['map_s_max']:.1f} s), reduce {one['reduce_s']:.1f} s / {reduce_peak:.0f} MiB"
            )
            print(f"  partitioned, 2 workers:  {two['wall_s']:7.1f} s")
            peak = max(one["map_peak_mib_max"], one["reduce_peak_mib"])
            print(
                f"  ratios: time 1 worker / whole {one['wall_s'] / whole_s:.2f}, 2 workers / 1 worker"
                f" {two['wall_s'] / one['wall_s']:.2f}; largest task's peak / whole {peak / whole_peak:.2f}"
            )
            print("  reports: identical (after ordering ties)")


if __name__ == "__main__":
    main()
