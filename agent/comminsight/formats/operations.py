"""The one decoder from profiler records (``ci_op_record``) to operations-table rows.

Every path that turns this project's records into operations goes through here, so the same bytes
give the same rows whatever carried them: raw logs in a home (``comminsight.importers.rawlog``),
sealed archives (``comminsight.importers.archive``, the CLI), the site's ingest into its operations
store (``apps.workloads.ingest``) and its reads back (``apps.analysis.services.load_operations``), and
the agent's live diagnosis over ring records (``comminsight.agent.diagnosis``). Column by column the
mapping is the ``rawlog`` table of docs/formats/evidence.md; layouts come from ``comminsight_ring.h``.

Decoding takes two steps, because one of them needs every rank's rows:

1. :func:`segment_rows` maps each segment's records on their own (its header and its valid records).
   A P2P record names its peer as a rank *in the communicator*; the row keeps that in the extra
   column :data:`PEER_IN_COMM` and leaves ``peer`` null.
2. :func:`finish` maps those peers to global ranks through the rows of the same communicator (any
   rank's segment says which global rank holds which communicator rank), drops the extra column and
   puts the rows in one canonical order.

A store that keeps step-1 rows (the site keeps them per archive and rank) runs step 2 over all it
reads back, so the answer never depends on how the records were grouped into files or archives.
Rows that did not come from records (other importers) have no :data:`PEER_IN_COMM` and pass
through :func:`finish` unchanged, except for the order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from comminsight.evidence.schema import SCHEMA, conform
from comminsight.formats import header
from comminsight.formats.rawlog import SegmentHeader
from comminsight.importers.normalise import dtypes, ops

SOURCE = "rawlog"  # every row decoded from records says so, whatever container carried the records
PEER_IN_COMM = "peer_in_comm"
ROWS_SCHEMA = SCHEMA.append(
    pa.field(
        PEER_IN_COMM,
        pa.int32(),
        metadata={b"doc": b"P2P peer as a rank in the communicator, until finish() maps it to a global rank"},
    )
)

# The canonical row order: by rank, process and record number, then by everything that can tell two
# rows apart, so that equal inputs grouped differently (files, archives, stores) give equal tables.
ORDER = (
    "rank",
    "pid",
    "record_id",
    "comm_id",
    "is_p2p",
    "seq",
    "state",
    "enqueue_ns",
    "start_ns",
    "end_ns",
    "op",
    "peer",
    "comm_rank",
    "comm_size",
    "count",
    "bytes",
    "dtype",
    "stream",
    "device",
    "n_channels",
    "algo",
    "proto",
    "comm_name",
    "host",
    "node",
    "workload",
)


@dataclass(frozen=True)
class SegmentRecords:
    """One segment's header and its valid records (``header.record_dtype()``)."""

    header: SegmentHeader
    records: np.ndarray


def _text(field: np.ndarray) -> pa.Array:
    """A fixed-size C char field as text: up to its first NUL (later bytes are stale), UTF-8 with replacement.

    Distinct values are decoded once (dictionary encoding over the raw bytes), then spread back.
    """
    width = field.dtype.itemsize
    raw = np.ascontiguousarray(field)
    fixed = pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), len(raw), [None, pa.py_buffer(raw)])
    encoded = pc.dictionary_encode(fixed)
    distinct = [value.split(b"\0", 1)[0].decode("utf-8", "replace") for value in encoded.dictionary.to_pylist()]
    return pa.array(distinct, pa.string()).take(encoded.indices)


def _empty_to_null(values: pa.Array) -> pa.Array:
    return pc.if_else(pc.equal(values, ""), pa.scalar(None, pa.string()), values)


def _nonzero(values: np.ndarray) -> pa.Array:
    """Times and handles: 0 (unknown) is null. uint64 values above int64 (hostile) are null too."""
    big = values > np.uint64(np.iinfo(np.int64).max)
    as_int = values.astype(np.int64)
    return pa.array(as_int, mask=(values == 0) | big)


def _nonnegative(values: np.ndarray) -> pa.Array:
    as_int = values.astype(np.int32)
    return pa.array(as_int, mask=as_int < 0)


def _labels(per_segment: list[str | None], counts: np.ndarray) -> pa.Array:
    """One label per segment spread over its rows, as a dictionary column (one string per segment)."""
    codes = np.repeat(np.arange(len(per_segment), dtype=np.int32), counts)
    return pa.DictionaryArray.from_arrays(pa.array(codes), pa.array(per_segment, pa.string()))


def segment_rows(parts: Sequence[SegmentRecords]) -> pa.Table:
    """Step 1: the records of ``parts`` as rows of :data:`ROWS_SCHEMA` (P2P peers still communicator ranks)."""
    c = header.constants()
    parts = [part for part in parts if len(part.records)]
    if not parts:
        return ROWS_SCHEMA.empty_table()
    counts = np.array([len(part.records) for part in parts], dtype=np.int64)
    rec = np.concatenate([part.records for part in parts]) if len(parts) > 1 else parts[0].records
    n = len(rec)
    hosts = [part.header.host or None for part in parts]

    header_rank = np.repeat(np.array([part.header.global_rank for part in parts], np.int64), counts)
    # RANK from the segment header; a process without RANK falls back on its communicator rank.
    rank = np.where(header_rank >= 0, header_rank, rec["rank"].astype(np.int64)).astype(np.int32)
    is_p2p = rec["kind"] == c["CI_KIND_P2P"]
    gpu_times = (rec["flags"] & c["CI_FLAG_GPU_TIMES"]) != 0
    gpu_start = np.where(gpu_times, rec["gpu_start_ns"], np.uint64(0))
    gpu_end = np.where(gpu_times, rec["gpu_end_ns"], np.uint64(0))
    state_code = rec["state"]
    # TIMEOUT (the plugin's snapshot) and INFLIGHT (the agent's) are both an operation in flight.
    in_flight = (state_code == c["CI_STATE_TIMEOUT"]) | (state_code == c["CI_STATE_INFLIGHT"])
    state_index = np.select(
        [state_code == c["CI_STATE_COMPLETED"], state_code == c["CI_STATE_ABANDONED"], in_flight & (gpu_start > 0)],
        [0, 1, 2],
        default=3,
    ).astype(np.int32)
    state = pa.DictionaryArray.from_arrays(
        pa.array(state_index), pa.array(["completed", "abandoned", "started", "enqueued"], pa.string())
    )
    hashes, hash_index = np.unique(rec["comm_hash"], return_inverse=True)
    comm_id = pa.array([f"0x{int(h):016x}" for h in hashes.tolist()], pa.string()).take(
        pa.array(hash_index.astype(np.int32).ravel())
    )
    peer = rec["peer"].astype(np.int32)
    end = np.where(gpu_end > 0, gpu_end, rec["complete_ns"])

    columns = {
        "workload": _labels([part.header.workload_id or None for part in parts], counts),
        "node": _labels([part.header.node_ip or host for part, host in zip(parts, hosts, strict=True)], counts),
        "host": _labels(hosts, counts),
        "rank": rank,
        "pid": rec["pid"].astype(np.int32),
        "device": _nonnegative(rec["cuda_device"]),
        "comm_id": comm_id,
        "comm_name": _empty_to_null(_text(rec["comm_name"])),
        "comm_size": rec["nranks"].astype(np.int32),
        "comm_rank": rec["rank"].astype(np.int32),
        "op": ops(_text(rec["func"])),
        "is_p2p": is_p2p,
        "seq": rec["seq"].astype(np.int64),
        # NCCL numbers collectives per function per communicator; the plugin numbers P2P per (func, peer).
        "seq_kind": pa.DictionaryArray.from_arrays(pa.array(is_p2p.astype(np.int32)), pa.array(["func", "p2p"])),
        "count": rec["count"].astype(np.int64),
        "bytes": rec["bytes"].astype(np.int64),
        "dtype": dtypes(_empty_to_null(_text(rec["dtype"]))),
        # A collective's root stays a communicator rank; a P2P peer is mapped to a global rank by finish().
        "peer": pa.array(peer, mask=(peer < 0) | is_p2p),
        "state": state,
        "enqueue_ns": _nonzero(rec["enqueue_start_ns"]),
        "start_ns": _nonzero(gpu_start),
        "end_ns": _nonzero(end),
        "stream": _nonzero(rec["stream"]),
        "algo": _empty_to_null(_text(rec["algo"])),
        "proto": _empty_to_null(_text(rec["proto"])),
        "n_channels": rec["n_channels"].astype(np.int32),
        "record_id": _record_id(rec["record_seq"]),
        "source": pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array([SOURCE])),
    }
    rows = conform(pa.table(columns))
    return rows.append_column(ROWS_SCHEMA.field(PEER_IN_COMM), pa.array(peer, mask=(peer < 0) | ~is_p2p))


def _record_id(values: np.ndarray) -> pa.Array:
    return pa.array(values.astype(np.int64), mask=values > np.uint64(np.iinfo(np.int64).max))


def communicator_members(rows: pa.Table) -> pa.Table:
    """``(comm_id, comm_rank, rank)``: the global rank holding each communicator rank, from ``rows``' columns.

    One rank normally; when a hostile input claims two, the lowest. Partial answers (of batches, of
    partitions) combine by calling this again on their concatenation.
    """
    import polars as pl

    frame = pl.from_arrow(rows.select(["comm_id", "comm_rank", "rank"]))
    assert isinstance(frame, pl.DataFrame)
    known = frame.filter(pl.col("comm_rank").is_not_null()).group_by("comm_id", "comm_rank").agg(pl.col("rank").min())
    return known.sort("comm_id", "comm_rank").to_arrow()


def resolve_peers(rows: pa.Table, members: pa.Table | None = None) -> pa.Table:
    """``rows`` with P2P peers mapped to global ranks and :data:`PEER_IN_COMM` dropped (other columns as they are).

    ``rows`` need ``comm_id``, ``comm_rank``, ``rank`` and ``peer``. A peer is mapped through ``members``
    (:func:`communicator_members`; by default those of ``rows`` themselves, which is exact whenever
    ``rows`` hold every rank's rows of their communicators). Unknown peers stay null.
    """
    import polars as pl

    if PEER_IN_COMM not in rows.column_names:
        return rows
    if not rows.num_rows:
        return rows.drop_columns([PEER_IN_COMM])
    known = pl.from_arrow(communicator_members(rows) if members is None else members)
    assert isinstance(known, pl.DataFrame)
    known = known.rename({"comm_rank": "_peer", "rank": "_global"}).with_columns(
        pl.col("_peer").cast(pl.Int32), pl.col("_global").cast(pl.Int32)
    )
    frame = pl.from_arrow(rows)
    assert isinstance(frame, pl.DataFrame)
    frame = (
        frame.with_columns(pl.col(PEER_IN_COMM).alias("_peer"))
        .join(known, on=["comm_id", "_peer"], how="left")
        .with_columns(
            pl.when(pl.col(PEER_IN_COMM).is_not_null()).then(pl.col("_global")).otherwise(pl.col("peer")).alias("peer")
        )
        .drop("_peer", "_global", PEER_IN_COMM)
    )
    return (
        frame.to_arrow()
        .select([name for name in rows.column_names if name != PEER_IN_COMM])
        .cast(pa.schema([f for f in rows.schema if f.name != PEER_IN_COMM]))
    )


def finish(rows: pa.Table, members: pa.Table | None = None) -> pa.Table:
    """Step 2: P2P peers mapped to global ranks (:func:`resolve_peers`), rows in canonical order (SCHEMA)."""
    table = conform(resolve_peers(rows, members))
    if table.num_rows > 1:
        table = table.take(pc.sort_indices(table, [(name, "ascending") for name in ORDER], null_placement="at_end"))
    return table


def operations(parts: Sequence[SegmentRecords]) -> pa.Table:
    """The operations table of ``parts``: both steps at once (raw logs, an archive, live evidence)."""
    return finish(segment_rows(parts))
