"""Small synthetic operations tables for the analysis-job tests (built in columns, conformed once).

``hung_table``: a ring of ranks doing all-reduces in lockstep until one rank stops entering them.
``straggler_table``: steps of compute then bucketed all-reduces, one rank arriving late at every
collective (so its peers wait for it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from comminsight.evidence import conform

COMM = "0x00000000000000a1"
MS = 1_000_000
T0 = 1_700_000_000_000_000_000


def _table(columns: dict[str, object]) -> pa.Table:
    n = len(columns["rank"])  # type: ignore[arg-type]
    base = {
        "workload": ["job-1"] * n,
        "comm_id": [COMM] * n,
        "comm_name": ["world"] * n,
        "is_p2p": [False] * n,
        "seq_kind": ["comm"] * n,
        "op": ["all_reduce"] * n,
        "dtype": ["bfloat16"] * n,
        "source": ["synthetic"] * n,
    }
    base.update(columns)
    return conform(pa.table(base))


def hung_table(ranks: int = 4, ops: int = 10, stuck_rank: int = 2) -> pa.Table:
    """``ops`` completed all-reduces on every rank; then every rank but ``stuck_rank`` enters one more."""
    rank = np.repeat(np.arange(ranks), ops)
    seq = np.tile(np.arange(ops), ranks)
    start = T0 + seq * 10 * MS + rank * 10_000
    extra = np.array([r for r in range(ranks) if r != stuck_rank])
    last = ops
    return _table(
        {
            "rank": np.concatenate([rank, extra]),
            "node": [f"n{r // 2}" for r in np.concatenate([rank, extra])],
            "comm_size": [ranks] * (len(rank) + len(extra)),
            "comm_ranks": [list(range(ranks))] * (len(rank) + len(extra)),
            "seq": np.concatenate([seq, np.full(len(extra), last)]),
            "count": [1 << 20] * (len(rank) + len(extra)),
            "bytes": [2 << 20] * (len(rank) + len(extra)),
            "state": ["completed"] * len(rank) + ["started"] * len(extra),
            "enqueue_ns": np.concatenate([start - 100_000, np.full(len(extra), T0 + last * 10 * MS)]),
            "start_ns": np.concatenate([start, np.full(len(extra), T0 + last * 10 * MS + 50_000)]),
            "end_ns": np.concatenate([start + 2 * MS, np.full(len(extra), None)]),
            "stream": [7] * (len(rank) + len(extra)),
        }
    )


def straggler_table(
    ranks: int = 4, steps: int = 12, buckets: int = 3, late_rank: int = 3, late_ms: float = 20.0
) -> pa.Table:
    """Per step: 50 ms compute, then ``buckets`` all-reduces; ``late_rank`` arrives ``late_ms`` late each time."""
    per_rank = steps * buckets
    rank = np.repeat(np.arange(ranks), per_rank)
    index = np.tile(np.arange(per_rank), ranks)
    step = index // buckets
    bucket = index % buckets
    step_len = 50 * MS + buckets * 5 * MS + int(late_ms * MS)
    arrive = T0 + step * step_len + 50 * MS + bucket * 5 * MS
    arrive = arrive + np.where((rank == late_rank) & (bucket == 0), int(late_ms * MS), 0)
    arrive = arrive + np.where(bucket > 0, int(late_ms * MS), 0)
    # A collective ends when its last member arrived plus the transfer time.
    last_arrival = arrive.reshape(ranks, per_rank).max(axis=0)
    end = np.tile(last_arrival, ranks) + 4 * MS
    return _table(
        {
            "rank": rank,
            "node": [f"n{r // 2}" for r in rank],
            "comm_size": [ranks] * len(rank),
            "comm_ranks": [list(range(ranks))] * len(rank),
            "seq": index,
            # Gradient buckets of falling size, then a tiny loss all-reduce: a DDP-like step signature.
            "count": (4 << 20) >> (bucket * 2),
            "bytes": (8 << 20) >> (bucket * 2),
            "state": ["completed"] * len(rank),
            "enqueue_ns": arrive - 10_000,
            "start_ns": arrive,
            "end_ns": end,
            "stream": [7] * len(rank),
            "step": step,
        }
    )


def write_store(data_dir: Path, workload_id: int, table: pa.Table) -> list[Path]:
    """Write ``table`` where ingest would: one Parquet file per node and rank of the workload's store."""
    from apps.workloads.ingest import path_part

    written = []
    nodes = table.column("node").to_pylist()
    ranks = table.column("rank").to_pylist()
    for node, rank in sorted(set(zip(nodes, ranks, strict=True))):
        mask = pa.array([n == node and r == rank for n, r in zip(nodes, ranks, strict=True)])
        path = data_dir / "store" / f"workload-{workload_id}" / f"node-{path_part(node)}" / f"rank-{rank}" / "s.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table.filter(mask), path)
        written.append(path)
    return written
