"""Export the operations table as a Chrome JSON trace that Perfetto (ui.perfetto.dev) opens.

Layout: one process per rank ("rank 3 · host"), one thread (track) per CUDA stream, one
complete slice per operation over its execution span (GPU start to end; the CPU enqueue
span when the source has no execution times), instant events for operations that were
never observed to start (hung or scheduled-only), and flow arrows from each send to the
matching receive. Events are built as columns with polars and serialised in one pass.
"""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pyarrow as pa

from comminsight.evidence import PROGRESS_OP

_ARGS = ["comm_id", "comm_name", "comm_desc", "seq", "count", "bytes", "dtype", "peer", "state", "algo", "proto"]


def _us(column: str) -> pl.Expr:
    # Chrome traces count microseconds; keep sub-microsecond precision as a fraction.
    return pl.col(column).cast(pl.Float64) / 1000.0


def _args() -> pl.Expr:
    return pl.struct([pl.col(name) for name in _ARGS]).alias("args")


def _slice_name(op: pl.Expr) -> pl.Expr:
    """``all_reduce · TENSOR_MODEL_PARALLEL_GROUP``: the op and its group's joined name, when there is one."""
    desc = pl.when(pl.col("comm_desc") != "").then(pl.col("comm_desc"))
    name = pl.when((pl.col("comm_name") != "") & (pl.col("comm_name") != pl.col("comm_id"))).then(pl.col("comm_name"))
    group = pl.coalesce(desc, name)
    return pl.when(group.is_not_null()).then(op + pl.lit(" · ") + group).otherwise(op).alias("name")


def _track_ids(ops: pl.DataFrame) -> pl.DataFrame:
    """Number the streams of each rank 1..n (tid 0 stays free for process-level events)."""
    return ops.with_columns(pl.col("stream").fill_null(0)).with_columns(
        (pl.col("stream").rank("dense").over("rank").cast(pl.Int64)).alias("tid")
    )


def _slices(ops: pl.DataFrame) -> pl.DataFrame:
    executed = ops.filter(pl.col("start_ns").is_not_null() & pl.col("end_ns").is_not_null())
    enqueued_only = ops.filter(
        (pl.col("start_ns").is_null() | pl.col("end_ns").is_null()) & pl.col("enqueue_ns").is_not_null()
    )
    complete = executed.select(
        _slice_name(pl.col("op")),
        pl.lit("X").alias("ph"),
        _us("start_ns").alias("ts"),
        ((pl.col("end_ns") - pl.col("start_ns")).clip(lower_bound=0).cast(pl.Float64) / 1000.0).alias("dur"),
        pl.col("rank").alias("pid"),
        pl.col("tid"),
        pl.lit("collective").alias("cat"),
        _args(),
    )
    instants = enqueued_only.select(
        _slice_name(pl.col("op") + pl.lit(" (") + pl.col("state") + pl.lit(")")),
        pl.lit("i").alias("ph"),
        _us("enqueue_ns").alias("ts"),
        pl.lit(None, dtype=pl.Float64).alias("dur"),
        pl.col("rank").alias("pid"),
        pl.col("tid"),
        pl.lit("not_started").alias("cat"),
        _args(),
    )
    return pl.concat([complete, instants])


def _flows(ops: pl.DataFrame) -> pl.DataFrame:
    """Flow start/end events joining the k-th send a->b with the k-th receive b<-a on a communicator."""
    timed = ops.filter(pl.col("is_p2p") & pl.col("peer").is_not_null() & pl.col("start_ns").is_not_null())
    sends = timed.filter(pl.col("op") == "send").sort("start_ns")
    recvs = timed.filter(pl.col("op") == "recv").sort("start_ns")
    key = ["comm_id", "src", "dst"]
    sends = sends.with_columns(pl.col("rank").alias("src"), pl.col("peer").alias("dst"))
    recvs = recvs.with_columns(pl.col("peer").alias("src"), pl.col("rank").alias("dst"))
    sends = sends.with_columns(pl.int_range(pl.len()).over(key).alias("k"))
    recvs = recvs.with_columns(pl.int_range(pl.len()).over(key).alias("k"))
    pairs = sends.join(recvs, on=[*key, "k"], suffix="_r").with_row_index("id", offset=1)
    common = [pl.lit("p2p").alias("name"), pl.lit("p2p").alias("cat"), pl.col("id").cast(pl.Int64)]
    starts = pairs.select(
        *common, pl.lit("s").alias("ph"), _us("start_ns").alias("ts"), pl.col("rank").alias("pid"), pl.col("tid")
    )
    ends = pairs.select(
        *common,
        pl.lit("f").alias("ph"),
        _us("start_ns_r").alias("ts"),
        pl.col("rank_r").alias("pid"),
        pl.col("tid_r").alias("tid"),
        pl.lit("e").alias("bp"),
    )
    return pl.concat([starts, ends], how="diagonal")


def _metadata(ops: pl.DataFrame) -> list[dict]:
    ranks = ops.group_by("rank").agg(pl.col("host").drop_nulls().first()).sort("rank")
    tracks = ops.group_by("rank", "tid").agg(pl.col("stream").first()).sort("rank", "tid")
    events: list[dict] = []
    for rank, host in ranks.iter_rows():
        label = f"rank {rank}" + (f" · {host}" if host else "")
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": label}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
    for rank, tid, stream in tracks.iter_rows():
        label = f"stream {stream:#x}" if stream else "stream (unknown)"
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": label}})
    return events


def _frames(table: pa.Table) -> tuple[list[dict], list[pl.DataFrame]]:
    ops = pl.from_arrow(table).filter(pl.col("op") != PROGRESS_OP)
    if ops.is_empty():
        return [], []
    ops = _track_ids(ops)
    slices = _slices(ops)
    flows = _flows(ops)
    # One frame per event shape, so that no event carries a null member (Perfetto rejects "dur": null).
    frames = [
        slices.filter(pl.col("ph") == "X"),
        slices.filter(pl.col("ph") == "i").drop("dur").with_columns(pl.lit("t").alias("s")),
        flows.filter(pl.col("ph") == "s").drop("bp"),
        flows.filter(pl.col("ph") == "f"),
    ]
    return _metadata(ops), [frame for frame in frames if not frame.is_empty()]


def trace_json(table: pa.Table) -> str:
    """The Chrome JSON trace for an operations table, serialised column-wise by polars."""
    metadata, frames = _frames(table)
    parts = [json.dumps(event, separators=(",", ":")) for event in metadata]
    # write_json emits "[{...},{...}]"; splice the frames' rows into one array.
    parts += [frame.write_json()[1:-1] for frame in frames]
    return '{"displayTimeUnit":"ns","traceEvents":[' + ",".join(part for part in parts if part) + "]}"


def write_trace(table: pa.Table, path: Path) -> int:
    """Write the trace for ``table`` to ``path`` atomically; returns the number of trace events."""
    metadata, frames = _frames(table)
    text = trace_json(table)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return len(metadata) + sum(frame.height for frame in frames)
