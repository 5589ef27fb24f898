"""Readers for what the profiler writes: raw-log segments and shared-memory rings.

Layouts come from ``comminsight_ring.h`` through :mod:`comminsight.formats.header` (never copied
by hand). A file is read once and viewed as an array of records with one ``np.frombuffer``; the
valid records (magic and FNV checksum verify) become a pyarrow table of record columns. A torn
last record (a crash mid-write) and corrupted records are skipped and counted, never fatal; a
bad header (magic, version, sizes) or a file too short for its header raises :class:`RawLogError`.
Specs: docs/formats/rawlog.md and docs/formats/ring.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from comminsight.formats import header

SEGMENT_SUFFIXES = (".cilog", ".cilog.sealed")
RING_SUFFIX = ".ring"
DEFAULT_MAX_BYTES = 4 << 30  # a segment is 64 MiB by default; anything near this is not ours
STATE_NAMES = {1: "completed", 2: "enqueued", 3: "abandoned", 4: "timeout"}
KIND_NAMES = {1: "coll", 2: "p2p"}


class RawLogError(ValueError):
    """A file that is not a readable segment or ring (bad magic, version, sizes, truncated header)."""


@dataclass(frozen=True)
class Segment:
    """One segment or ring snapshot: its header fields and its valid records as Arrow columns."""

    path: Path
    header: dict[str, Any]
    table: pa.Table
    invalid_records: int = 0
    torn_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _decode_header(raw: np.void) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in raw.dtype.names or ():
        if name.startswith("_"):
            continue
        value = raw[name]
        # A C string ends at its first NUL; bytes after it are stale, not text.
        out[name] = value.split(b"\0", 1)[0].decode("utf-8", "replace") if isinstance(value, bytes) else value.item()
    return out


def _read_bytes(path: Path, max_bytes: int) -> bytes:
    size = path.stat().st_size
    if size > max_bytes:
        raise RawLogError(f"{path}: {size} bytes is larger than the {max_bytes}-byte limit")
    return path.read_bytes()


def _check_header(path: Path, fields: dict[str, Any], magic_name: str, size_name: str) -> None:
    const = header.constants()
    if fields["magic"] != const[magic_name]:
        raise RawLogError(f"{path}: bad magic {fields['magic']:#x}, not a CommInsight {magic_name[3:7].lower()} file")
    if fields["version"] != const["CI_FORMAT_VERSION"]:
        known = const["CI_FORMAT_VERSION"]
        raise RawLogError(
            f"{path}: unsupported version {fields['version']} (the file says format version {fields['version']}; "
            f"this reader knows {known})"
        )
    if fields["header_size"] != const[size_name] or fields["record_size"] != const["CI_RECORD_SIZE"]:
        raise RawLogError(
            f"{path}: header_size {fields['header_size']} / record_size {fields['record_size']} do not match "
            f"{const[size_name]} / {const['CI_RECORD_SIZE']}"
        )


def _table(records: np.ndarray, constant_columns: dict[str, Any]) -> pa.Table:
    table = header.records_to_arrow(records)
    n = table.num_rows
    for name, value in constant_columns.items():
        table = table.append_column(name, pa.repeat(pa.scalar(value), n))
    return table


@dataclass(frozen=True)
class SegmentHeader:
    """The decoded ``ci_log_header`` of a segment."""

    pid: int
    start_ns: int
    segment_index: int
    local_rank: int
    global_rank: int
    world_size: int
    host: str
    workload_id: str
    node_ip: str


def _segment_fields(raw: bytes | memoryview, path: Path) -> dict[str, Any]:
    """The header fields of a segment's first bytes, validated; RawLogError when they cannot be trusted."""
    hdr_dtype = header.struct_dtype("ci_log_header")
    if len(raw) < hdr_dtype.itemsize:
        raise RawLogError(f"{path}: {len(raw)} bytes, shorter than the {hdr_dtype.itemsize}-byte segment header")
    fields = _decode_header(np.frombuffer(raw, hdr_dtype, count=1)[0])
    _check_header(path, fields, "CI_LOG_MAGIC", "CI_LOG_HEADER_SIZE")
    return fields


def parse_header(raw: bytes | memoryview, path: Path) -> SegmentHeader:
    """Validate and decode a segment header (the first CI_LOG_HEADER_SIZE bytes of ``raw``)."""
    fields = _segment_fields(raw, path)
    return SegmentHeader(**{name: fields[name] for name in SegmentHeader.__dataclass_fields__})


def records_from_bytes(raw: bytes | memoryview) -> tuple[np.ndarray, int, int]:
    """(valid records, whole records examined, corrupt count) of a records region; a torn tail is ignored."""
    rec_size = header.constants()["CI_RECORD_SIZE"]
    whole = len(raw) // rec_size
    records = np.frombuffer(raw, dtype=header.record_dtype(), count=whole)
    if whole == 0:
        return records, 0, 0
    ok = header.valid_records(records)
    corrupt = int(whole - np.count_nonzero(ok))
    return (records[ok] if corrupt else records), whole, corrupt


def segment_records(raw: bytes | memoryview, path: Path) -> tuple[SegmentHeader, np.ndarray, int]:
    """(header, valid records, corrupt count) of a whole segment's bytes; RawLogError for a bad header.

    What every reader of segments uses (files in a home, archive members, the agent's seals); the
    records become operations through ``comminsight.formats.operations``.
    """
    hdr = parse_header(raw, path)
    records, _, corrupt = records_from_bytes(memoryview(raw)[header.constants()["CI_LOG_HEADER_SIZE"] :])
    return hdr, records, corrupt


def read_segment_records(path: str | Path, max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[SegmentHeader, np.ndarray, int]:
    """:func:`segment_records` of the segment file at ``path`` (at most ``max_bytes``)."""
    path = Path(path)
    return segment_records(_read_bytes(path, max_bytes), path)


def read_segment(path: str | Path, max_bytes: int = DEFAULT_MAX_BYTES) -> Segment:
    """Reads one raw-log segment (``.cilog`` or ``.cilog.sealed``).

    Returns its header fields and a table of its valid records, with the segment's host, pid,
    ranks, workload and file name as columns too. Raises RawLogError for a bad or truncated header.
    """
    path = Path(path)
    data = _read_bytes(path, max_bytes)
    fields = _segment_fields(data, path)
    body = memoryview(data)[header.constants()["CI_LOG_HEADER_SIZE"] :]
    records, _, invalid = records_from_bytes(body)
    constants = {
        "host": fields["host"],
        "workload_id": fields["workload_id"],
        "global_rank": fields["global_rank"],
        "local_rank": fields["local_rank"],
        "segment_index": fields["segment_index"],
        "segment": path.name,
    }
    torn = len(body) % header.constants()["CI_RECORD_SIZE"]
    return Segment(path, fields, _table(records, constants), invalid, torn)


def read_ring(path: str | Path, max_bytes: int = DEFAULT_MAX_BYTES) -> Segment:
    """Reads the committed records of a shared-memory ring file (a snapshot; the ring is not consumed).

    The window is ``[max(tail, head - capacity), head)``; records whose checksum fails (overwritten
    while read) are skipped and counted. Raises RawLogError for a bad header or a short file.
    """
    path = Path(path)
    data = _read_bytes(path, max_bytes)
    hdr_dtype = header.struct_dtype("ci_ring_header")
    if len(data) < hdr_dtype.itemsize:
        raise RawLogError(f"{path}: {len(data)} bytes, shorter than the {hdr_dtype.itemsize}-byte ring header")
    fields = _decode_header(np.frombuffer(data, hdr_dtype, count=1)[0])
    _check_header(path, fields, "CI_RING_MAGIC", "CI_RING_HEADER_SIZE")
    capacity = fields["capacity"]
    if capacity == 0 or capacity & (capacity - 1):
        raise RawLogError(f"{path}: capacity {capacity} is not a power of two")
    rec_dtype = header.record_dtype()
    if len(data) < hdr_dtype.itemsize + capacity * rec_dtype.itemsize:
        raise RawLogError(f"{path}: truncated: {len(data)} bytes for {capacity} records")
    head, tail = fields["head"], fields["tail"]
    if tail > head:
        raise RawLogError(f"{path}: tail {tail} is ahead of head {head}")
    slots = np.frombuffer(data, rec_dtype, count=capacity, offset=hdr_dtype.itemsize)
    start = max(tail, head - capacity)
    window = slots[np.arange(start, head, dtype=np.uint64) & np.uint64(capacity - 1)]
    valid = header.valid_records(window) if len(window) else np.zeros(0, dtype=bool)
    constants = {"host": fields["host"], "segment": path.name}
    extra = {"head": head, "tail": tail, "dropped": fields["dropped"], "lost": fields["lost"]}
    return Segment(path, fields, _table(window[valid], constants), int((~valid).sum()), 0, extra)


def segment_files(path: str | Path) -> list[Path]:
    """The segment (and ring) files at ``path``: the file itself, or those in the directory, sorted."""
    path = Path(path)
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith((*SEGMENT_SUFFIXES, RING_SUFFIX)))
    if not path.exists():
        raise FileNotFoundError(path)
    return [path]


def read_any(path: str | Path, max_bytes: int = DEFAULT_MAX_BYTES) -> Segment:
    """One segment or ring file, chosen by its magic (a ring file is recognised whatever its name)."""
    path = Path(path)
    with path.open("rb") as f:
        magic = int.from_bytes(f.read(8).ljust(8, b"\0"), "little")
    if magic == header.constants()["CI_RING_MAGIC"]:
        return read_ring(path, max_bytes)
    return read_segment(path, max_bytes)


def read_logs(paths: Iterable[str | Path] | str | Path, max_bytes: int = DEFAULT_MAX_BYTES) -> pa.Table:
    """All valid records under ``paths`` (files or directories of segments/rings) as one Arrow table."""
    if isinstance(paths, str | Path):
        paths = [paths]
    tables = [read_any(f, max_bytes).table for p in paths for f in segment_files(p)]
    tables = [t for t in tables if t.num_rows]
    if not tables:
        return _table(np.zeros(0, header.record_dtype()), {"host": "", "segment": ""})
    return pa.concat_tables(tables, promote_options="default")


#: the columns of :func:`operations_view`, in order
VIEW_COLUMNS = [
    "comm_hash",
    "comm_name",
    "rank",
    "nranks",
    "nnodes",
    "kind",
    "func",
    "seq",
    "count",
    "bytes",
    "dtype",
    "peer",
    "root",
    "algo",
    "proto",
    "n_channels",
    "stream",
    "enqueue_ns",
    "enqueue_end_ns",
    "complete_ns",
    "gpu_start_ns",
    "gpu_end_ns",
    "state",
    "host",
    "pid",
    "tid",
    "cuda_device",
    "record_seq",
]


def _names(column: pa.Array, names: dict[int, str]) -> pa.Array:
    keys = pa.array(list(names), pa.uint8())
    values = pa.array(list(names.values()), pa.string())
    return pc.fill_null(pc.take(values, pc.index_in(column, value_set=keys)), "unknown")


def _zero_as_null(column: pa.Array) -> pa.Array:
    return pc.if_else(pc.equal(column, 0), pa.scalar(None, column.type), column)


def operations_view(records: pa.Table) -> pa.Table:
    """The per-operation view of a records table (what ``comminsight logs show`` prints): named states
    and kinds, peer/root split, 0 times as null."""
    if records.num_rows == 0:
        return pa.table({name: pa.array([], pa.null()) for name in VIEW_COLUMNS})
    records = records.combine_chunks()
    kind = records["kind"]
    is_p2p = pc.equal(kind, 2)
    peer = records["peer"]
    none = pa.scalar(None, peer.type)
    columns = {
        "comm_hash": records["comm_hash"],
        "comm_name": pc.if_else(pc.equal(records["comm_name"], ""), pa.scalar(None, pa.string()), records["comm_name"]),
        "rank": records["rank"],
        "nranks": records["nranks"],
        "nnodes": records["nnodes"],
        "kind": _names(kind, KIND_NAMES),
        "func": records["func"],
        "seq": records["seq"],
        "count": records["count"],
        "bytes": records["bytes"],
        "dtype": records["dtype"],
        "peer": pc.if_else(is_p2p, peer, none),
        "root": pc.if_else(pc.and_(pc.invert(is_p2p), pc.greater_equal(peer, 0)), peer, none),
        "algo": records["algo"],
        "proto": records["proto"],
        "n_channels": records["n_channels"],
        "stream": records["stream"],
        "enqueue_ns": records["enqueue_start_ns"],
        "enqueue_end_ns": _zero_as_null(records["enqueue_end_ns"]),
        "complete_ns": _zero_as_null(records["complete_ns"]),
        "gpu_start_ns": _zero_as_null(records["gpu_start_ns"]),
        "gpu_end_ns": _zero_as_null(records["gpu_end_ns"]),
        "state": _names(records["state"], STATE_NAMES),
        "host": records["host"],
        "pid": records["pid"],
        "tid": records["tid"],
        "cuda_device": records["cuda_device"],
        "record_seq": records["record_seq"],
    }
    view = pa.table(columns)
    return view.sort_by([("host", "ascending"), ("pid", "ascending"), ("record_seq", "ascending")])
