"""This project's raw-log segments (``*.cilog``, ``*.cilog.sealed``) -> the operations table.

A segment is a ``ci_log_header`` followed by 256-byte ``ci_op_record``s (layout:
native/profiler/include/comminsight_ring.h, spec docs/formats/rawlog.md). Records are read
with one ``np.frombuffer`` per segment; records whose magic or checksum fail (a torn tail
after a crash) are dropped, never fatal. A path may be a segment, a directory of segments,
or a COMMINSIGHT_HOME holding ``inspector_logs/``.

The segment reader here is deliberately small (``read_segment``); it can give way to
``comminsight.formats.rawlog`` once that module exists, without changing the mapping.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from comminsight.formats.header import constants, record_dtype, struct_dtype, valid_records
from comminsight.importers import EvidenceError, Importer, register
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
    found = [p for p in sorted(directory.iterdir()) if p.is_file() and _is_segment_name(p)]
    if len(found) > MAX_SEGMENTS:
        raise EvidenceError(f"{path}: more than {MAX_SEGMENTS} segments")
    return found


def detect(path: Path) -> bool:
    """A segment (by name and magic), or a directory / COMMINSIGHT_HOME holding segments."""
    if path.is_file():
        return _is_segment_name(path) and _has_magic(path)
    if path.is_dir():
        directory = path / "inspector_logs" if (path / "inspector_logs").is_dir() else path
        return any(_is_segment_name(p) and _has_magic(p) for p in sorted(directory.iterdir())[:256] if p.is_file())
    return False


def read_segment(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(header record, valid op records) of one segment; raises EvidenceError on a bad header."""
    c = constants()
    header_dtype = struct_dtype("ci_log_header")
    size = path.stat().st_size
    if size > MAX_SEGMENT_BYTES:
        raise EvidenceError(f"{path}: {size} bytes is over the {MAX_SEGMENT_BYTES}-byte limit for a segment")
    data = path.read_bytes()
    if len(data) < c["CI_LOG_HEADER_SIZE"]:
        raise EvidenceError(f"{path}: {len(data)} bytes is shorter than a segment header")
    header = np.frombuffer(data, dtype=header_dtype, count=1)[0]
    if int(header["magic"]) != c["CI_LOG_MAGIC"]:
        raise EvidenceError(f"{path}: not a raw-log segment (bad magic)")
    if int(header["version"]) != c["CI_FORMAT_VERSION"]:
        raise EvidenceError(f"{path}: segment format version {int(header['version'])} is not supported")
    header_size, record_size = int(header["header_size"]), int(header["record_size"])
    if header_size != c["CI_LOG_HEADER_SIZE"] or record_size != c["CI_RECORD_SIZE"]:
        raise EvidenceError(f"{path}: header declares sizes {header_size}/{record_size}, expected 512/256")
    n = (len(data) - header_size) // record_size  # a torn last record is simply not counted
    records = np.frombuffer(data, dtype=record_dtype(), count=n, offset=header_size)
    return header, records[valid_records(records)]


def _text(column: np.ndarray) -> pa.Array:
    """Fixed-size char fields as strings (empty -> null), hashing in Arrow and decoding each distinct value once."""
    encoded = pc.dictionary_encode(pa.array(column, pa.binary()))
    decoded = [bytes(v).split(b"\0", 1)[0].decode("utf-8", "replace") or None for v in encoded.dictionary.to_pylist()]
    return pa.array(decoded, pa.string()).take(encoded.indices)


def _nonzero(column: np.ndarray) -> pa.Array:
    values = column.astype(np.int64)
    return pa.array(values, mask=values == 0)


def _header_text(header: Any, field: str) -> str | None:
    return bytes(header[field]).split(b"\0", 1)[0].decode("utf-8", "replace") or None


def _table(segments: list[Path], path: Path) -> pa.Table:
    """All segments' valid records as one operations table (records concatenated, converted once)."""
    c = constants()
    parts, ranks, labels = [], [], []
    for segment in segments:
        header, records = read_segment(segment)
        parts.append(records)
        global_rank = int(header["global_rank"])
        # RANK from the segment header; a process without RANK falls back on its communicator rank.
        ranks.append(np.full(len(records), global_rank, np.int32) if global_rank >= 0 else records["rank"])
        host = _header_text(header, "host")
        labels.append((host, _header_text(header, "node_ip") or host, _header_text(header, "workload_id")))
    counts = np.array([len(p) for p in parts], dtype=np.int64)
    segment_of = pa.array(np.repeat(np.arange(len(parts), dtype=np.int32), counts))

    def per_segment(index: int) -> pa.Array:
        # A dictionary-encoded column: one string per segment, one int per record.
        return pa.DictionaryArray.from_arrays(segment_of, pa.array([label[index] for label in labels], pa.string()))

    def labelled(codes: np.ndarray, names: list[str]) -> pa.Array:
        return pa.DictionaryArray.from_arrays(pa.array(codes.astype(np.int32)), pa.array(names, pa.string()))

    rec = np.concatenate(parts) if parts else np.zeros(0, record_dtype())
    n = len(rec)
    is_p2p = rec["kind"] == c["CI_KIND_P2P"]
    gpu_times = (rec["flags"] & c["CI_FLAG_GPU_TIMES"]) != 0
    state_code = rec["state"]
    started = gpu_times & (rec["gpu_start_ns"] > 0)
    state = labelled(
        np.select(
            [
                state_code == c["CI_STATE_COMPLETED"],
                state_code == c["CI_STATE_ABANDONED"],
                (state_code == c["CI_STATE_TIMEOUT"]) & started,
            ],
            [0, 1, 2],
            default=3,
        ),
        ["completed", "abandoned", "started", "enqueued"],
    )
    encoded = pc.dictionary_encode(pa.array(rec["comm_hash"]))
    comm_id = pa.array([f"0x{int(h):016x}" for h in encoded.dictionary.to_pylist()], pa.string()).take(encoded.indices)
    peer = rec["peer"].astype(np.int32)
    gpu_start = np.where(gpu_times, rec["gpu_start_ns"], 0)
    gpu_end = np.where(gpu_times, rec["gpu_end_ns"], 0)
    end = np.where(gpu_end > 0, gpu_end, rec["complete_ns"])
    device = rec["cuda_device"].astype(np.int32)

    columns = {
        "workload": per_segment(2),
        "node": per_segment(1),
        "host": per_segment(0),
        "rank": np.concatenate(ranks).astype(np.int32) if ranks else np.zeros(0, np.int32),
        "pid": rec["pid"].astype(np.int32),
        "device": pa.array(device, mask=device < 0),
        "comm_id": comm_id,
        "comm_name": _text(rec["comm_name"]),
        "comm_size": rec["nranks"].astype(np.int32),
        "comm_rank": rec["rank"].astype(np.int32),
        "op": ops(_text(rec["func"])),
        "is_p2p": is_p2p,
        "seq": rec["seq"].astype(np.int64),
        # NCCL numbers collectives per function per communicator; the plugin numbers P2P per (func, peer).
        "seq_kind": labelled(is_p2p, ["func", "p2p"]),
        "count": rec["count"].astype(np.int64),
        "bytes": rec["bytes"].astype(np.int64),
        "dtype": dtypes(_text(rec["dtype"])),
        "peer": pa.array(peer, mask=peer < 0),
        "state": state,
        "enqueue_ns": _nonzero(rec["enqueue_start_ns"]),
        "start_ns": _nonzero(gpu_start),
        "end_ns": _nonzero(end),
        "stream": _nonzero(rec["stream"]),
        "algo": _text(rec["algo"]),
        "proto": _text(rec["proto"]),
        "n_channels": rec["n_channels"].astype(np.int32),
        "record_id": rec["record_seq"].astype(np.int64),
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
