"""This project's raw-log segments (``*.cilog``, ``*.cilog.sealed``) -> the operations table.

A segment is a ``ci_log_header`` followed by 256-byte ``ci_op_record``s (layout:
native/profiler/include/comminsight_ring.h, spec docs/formats/rawlog.md). Segments are read
by the profiler's own reader, ``comminsight.formats.rawlog`` (one ``np.frombuffer`` per segment,
records as Arrow columns); records whose magic or checksum fail (a torn tail after a crash)
are dropped, never fatal. The records of all segments are then mapped together, column by
column. A path may be a segment, a directory of segments, or a COMMINSIGHT_HOME holding
``inspector_logs/``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from comminsight.formats import rawlog as rawlog_format
from comminsight.formats.header import constants
from comminsight.importers import EvidenceError, Importer, directory_holds, evidence_files, register
from comminsight.importers.columns import to_table
from comminsight.importers.normalise import dtypes, ops

NAME = "rawlog"
MAX_SEGMENT_BYTES = 8 << 30
MAX_SEGMENTS = 1_000_000
_SUFFIXES = (".cilog", ".cilog.sealed")


def _is_segment_name(path: Path) -> bool:
    return path.name.endswith(_SUFFIXES)


def _has_magic(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            head = f.read(8)
    except OSError:
        return False
    return len(head) == 8 and int.from_bytes(head, "little") == constants()["CI_LOG_MAGIC"]


def _segments(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    directory = path / "inspector_logs" if (path / "inspector_logs").is_dir() else path
    found = evidence_files(directory, _is_segment_name)
    if len(found) > MAX_SEGMENTS:
        raise EvidenceError(f"{path}: more than {MAX_SEGMENTS} segments")
    return found


def detect(path: Path) -> bool:
    """A segment (by name and magic), or a directory / COMMINSIGHT_HOME holding segments."""
    if path.is_file():
        return _is_segment_name(path) and _has_magic(path)
    if path.is_dir():
        directory = path / "inspector_logs" if (path / "inspector_logs").is_dir() else path
        return directory_holds(directory, lambda p: _is_segment_name(p) and _has_magic(p))
    return False


def _empty_to_null(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Unset char fields (empty text) as nulls."""
    return pc.if_else(pc.equal(values, ""), pa.scalar(None, pa.string()), values)


def _nonzero(column: np.ndarray) -> pa.Array:
    values = column.astype(np.int64, copy=False)
    return pa.array(values, mask=values == 0)


def _read(segment: Path) -> rawlog_format.Segment:
    try:
        return rawlog_format.read_segment(segment, max_bytes=MAX_SEGMENT_BYTES)
    except rawlog_format.RawLogError as exc:
        raise EvidenceError(f"bad segment (magic, version, sizes or length): {exc}") from exc
    except OSError as exc:
        raise EvidenceError(f"{segment}: cannot read segment: {exc}") from exc


def _table(segments: list[Path], path: Path) -> pa.Table:
    """All segments' valid records as one operations table (records concatenated, mapped once as columns)."""
    c = constants()
    read = [_read(segment) for segment in segments]
    labels = []
    for segment in read:
        host = segment.header["host"] or None
        labels.append((host, segment.header["node_ip"] or host, segment.header["workload_id"] or None))
    counts = np.array([segment.table.num_rows for segment in read], dtype=np.int64)
    segment_of = pa.array(np.repeat(np.arange(len(read), dtype=np.int32), counts))

    def per_segment(index: int) -> pa.Array:
        # A dictionary-encoded column: one string per segment, one int per record.
        return pa.DictionaryArray.from_arrays(segment_of, pa.array([label[index] for label in labels], pa.string()))

    def labelled(codes: np.ndarray, names: list[str]) -> pa.Array:
        return pa.DictionaryArray.from_arrays(pa.array(codes.astype(np.int32)), pa.array(names, pa.string()))

    rec = pa.concat_tables([segment.table for segment in read]).combine_chunks()
    n = rec.num_rows

    def col(name: str) -> np.ndarray:
        return rec.column(name).to_numpy()

    # RANK from the segment header; a process without RANK falls back on its communicator rank.
    header_rank = np.repeat(np.array([segment.header["global_rank"] for segment in read], np.int64), counts)
    rank = np.where(header_rank >= 0, header_rank, col("rank")).astype(np.int32)
    is_p2p = col("kind") == c["CI_KIND_P2P"]
    gpu_times = (col("flags") & c["CI_FLAG_GPU_TIMES"]) != 0
    state_code = col("state")
    gpu_start = np.where(gpu_times, col("gpu_start_ns"), 0)
    gpu_end = np.where(gpu_times, col("gpu_end_ns"), 0)
    state = labelled(
        np.select(
            [
                state_code == c["CI_STATE_COMPLETED"],
                state_code == c["CI_STATE_ABANDONED"],
                (state_code == c["CI_STATE_TIMEOUT"]) & (gpu_start > 0),
            ],
            [0, 1, 2],
            default=3,
        ),
        ["completed", "abandoned", "started", "enqueued"],
    )
    encoded = pc.dictionary_encode(rec.column("comm_hash")).combine_chunks() if n else None
    comm_id = (
        pa.array([f"0x{int(h):016x}" for h in encoded.dictionary.to_pylist()], pa.string()).take(encoded.indices)
        if n
        else pa.array([], pa.string())
    )
    peer = col("peer").astype(np.int32)
    device = col("cuda_device").astype(np.int32)
    end = np.where(gpu_end > 0, gpu_end, col("complete_ns"))

    columns = {
        "workload": per_segment(2),
        "node": per_segment(1),
        "host": per_segment(0),
        "rank": rank,
        "pid": col("pid").astype(np.int32),
        "device": pa.array(device, mask=device < 0),
        "comm_id": comm_id,
        "comm_name": _empty_to_null(rec.column("comm_name")),
        "comm_size": col("nranks").astype(np.int32),
        "comm_rank": col("rank").astype(np.int32),
        "op": ops(rec.column("func")),
        "is_p2p": is_p2p,
        "seq": col("seq").astype(np.int64),
        # NCCL numbers collectives per function per communicator; the plugin numbers P2P per (func, peer).
        "seq_kind": labelled(is_p2p, ["func", "p2p"]),
        "count": col("count").astype(np.int64),
        "bytes": col("bytes").astype(np.int64),
        "dtype": dtypes(_empty_to_null(rec.column("dtype"))),
        "peer": pa.array(peer, mask=peer < 0),
        "state": state,
        "enqueue_ns": _nonzero(col("enqueue_start_ns")),
        "start_ns": _nonzero(gpu_start),
        "end_ns": _nonzero(end),
        "stream": _nonzero(col("stream")),
        "algo": _empty_to_null(rec.column("algo")),
        "proto": _empty_to_null(rec.column("proto")),
        "n_channels": col("n_channels").astype(np.int32),
        "record_id": col("record_seq").astype(np.int64),
        "source": labelled(np.zeros(n, np.int32), [NAME]),
    }
    return to_table(columns, path)


def _peers_to_global(table: pa.Table) -> pa.Table:
    """P2P peers are communicator ranks in the records: map them to global ranks where a log says which."""
    import polars as pl

    df = pl.from_arrow(table)
    assert isinstance(df, pl.DataFrame)
    known = df.select("comm_id", pl.col("comm_rank").alias("peer"), pl.col("rank").alias("peer_global")).unique(
        subset=["comm_id", "peer"]
    )
    df = df.join(known, on=["comm_id", "peer"], how="left").with_columns(
        pl.when(pl.col("is_p2p")).then(pl.col("peer_global")).otherwise(pl.col("peer")).alias("peer")
    )
    return df.drop("peer_global").to_arrow().cast(table.schema)


def load(path: Path) -> pa.Table:
    """Every valid record of every segment under ``path``."""
    path = Path(path)
    if not path.exists():
        raise EvidenceError(f"{path}: no such file or directory")
    segments = _segments(path)
    if not segments:
        raise EvidenceError(f"{path}: no raw-log segments (*.cilog, *.cilog.sealed)")
    table = _table(segments, path)
    has_p2p = table.num_rows and pc.any(table.column("is_p2p")).as_py()
    return _peers_to_global(table) if has_p2p else table


register(Importer(NAME, detect, load))
