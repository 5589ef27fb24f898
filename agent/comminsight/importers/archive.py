"""Importer for sealed agent archives (``*.tar.zst`` with a ``comminsight.archive`` manifest).

Each ``segments/`` member is a raw-log segment; its records become operations-table rows. The
conversion from records to rows is ``comminsight.importers.rawlog``'s when that module offers one
(``records_to_operations(records, segment_header, ...)``), else the local vectorised mapping below.
Archives are read with ``comminsight.formats.archive.read_archive`` (streamed, capped, verified).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import zstandard

from comminsight.evidence.schema import conform, empty_table
from comminsight.formats import header
from comminsight.formats.archive import KIND, ArchiveError, read_archive
from comminsight.formats.rawlog import RawLogError as SegmentError
from comminsight.formats.rawlog import SegmentHeader, parse_header, records_from_bytes
from comminsight.importers import EvidenceError, Importer, register

_OPS = {
    "AllReduce": "all_reduce",
    "AllGather": "all_gather",
    "ReduceScatter": "reduce_scatter",
    "Broadcast": "broadcast",
    "Reduce": "reduce",
    "AllToAll": "all_to_all",
    "AlltoAll": "all_to_all",
    "Send": "send",
    "Recv": "recv",
    "Gather": "gather",
    "Scatter": "scatter",
    "Barrier": "barrier",
}


def detect(path: Path) -> bool:
    """A ``.tar.zst`` whose first tar member is manifest.json of kind comminsight.archive."""
    path = Path(path)
    if not path.is_file() or not path.name.endswith(".tar.zst"):
        return False
    try:
        with open(path, "rb") as handle:
            head = zstandard.ZstdDecompressor().stream_reader(handle).read(1 << 16)
    except (OSError, zstandard.ZstdError):
        return False
    return head[:13] == b"manifest.json" and f'"kind": "{KIND}"'.encode() in head


def _text(column: np.ndarray) -> pa.Array:
    values, inverse = np.unique(column, return_inverse=True)
    decoded = pa.array([bytes(v).split(b"\0", 1)[0].decode("utf-8", "replace") for v in values], pa.string())
    return decoded.take(pa.array(inverse.astype(np.int32)))


def _c_strings(field: np.ndarray) -> np.ndarray:
    """A fixed-size C char field as text: up to the first NUL (the bytes after it are stale, not part of it)."""
    width = field.dtype.itemsize
    raw = np.ascontiguousarray(field).view(np.uint8).reshape(len(field), width)
    cleared = np.where(np.cumsum(raw == 0, axis=1) > 0, 0, raw).astype(np.uint8)
    return np.char.decode(np.ascontiguousarray(cleared).view(f"S{width}").ravel(), "utf-8", "replace")


def records_to_table(records: np.ndarray, hdr: SegmentHeader, manifest: dict[str, Any]) -> pa.Table:
    """Local mapping of ci_op_record's to the operations table (used when rawlog offers none)."""
    consts = header.constants()
    n = len(records)
    funcs = _text(records["func"])
    ops = pa.array([_OPS.get(f, "other") for f in funcs.to_pylist()], pa.string()) if n else pa.array([], pa.string())
    state_names = np.array(["enqueued", "completed", "enqueued", "abandoned", "started"], dtype=object)
    raw_state = records["state"].astype(np.int64)
    states = state_names[np.where((raw_state >= 1) & (raw_state <= 4), raw_state, 0)]
    # a TIMEOUT snapshot is an op in flight: started when the GPU reported a start, else only enqueued
    started = records["gpu_start_ns"] > 0
    states = np.where((raw_state == consts["CI_STATE_TIMEOUT"]) & ~started, "enqueued", states)
    gpu = (records["flags"] & consts["CI_FLAG_GPU_TIMES"]) != 0
    is_p2p = records["kind"] == consts["CI_KIND_P2P"]
    comm_ids = pa.array([f"0x{int(h):016x}" for h in np.unique(records["comm_hash"])], pa.string())
    _, comm_inverse = np.unique(records["comm_hash"], return_inverse=True)
    rank = hdr.global_rank if hdr.global_rank >= 0 else None

    def nullable(values: np.ndarray, mask: np.ndarray) -> pa.Array:
        return pa.array(values.astype(np.int64), mask=~mask)

    table = pa.table(
        {
            "workload": pa.array([manifest.get("workload_id") or hdr.workload_id] * n, pa.string()),
            "node": pa.array([manifest.get("node") or hdr.node_ip or hdr.host] * n, pa.string()),
            "host": pa.array([hdr.host] * n, pa.string()),
            "rank": pa.array(np.full(n, rank if rank is not None else -1, dtype=np.int32))
            if rank is not None
            else pa.array(records["rank"].astype(np.int32)),
            "pid": pa.array(records["pid"].astype(np.int32)),
            "device": pa.array(records["cuda_device"].astype(np.int32), mask=records["cuda_device"] < 0),
            "comm_id": comm_ids.take(pa.array(comm_inverse.astype(np.int32))),
            "comm_name": _text(records["comm_name"]),
            "comm_size": pa.array(records["nranks"].astype(np.int32)),
            "comm_rank": pa.array(records["rank"].astype(np.int32)),
            "op": ops,
            "is_p2p": pa.array(is_p2p),
            "seq": pa.array(records["seq"].astype(np.int64)),
            "seq_kind": pa.array(np.where(is_p2p, "p2p", "func").astype(object), pa.string()),
            "count": pa.array(records["count"].astype(np.int64)),
            "bytes": pa.array(records["bytes"].astype(np.int64)),
            "dtype": pa.array(
                np.char.lower(np.char.replace(_c_strings(records["dtype"]), "nccl", "")).astype(object),
                pa.string(),
            ),
            "peer": pa.array(records["peer"].astype(np.int32), mask=records["peer"] < 0),
            "state": pa.array(states.astype(object), pa.string()),
            "enqueue_ns": nullable(records["enqueue_end_ns"], records["enqueue_end_ns"] > 0),
            "start_ns": nullable(np.where(gpu, records["gpu_start_ns"], 0), gpu & (records["gpu_start_ns"] > 0)),
            "end_ns": nullable(
                np.where(gpu, records["gpu_end_ns"], records["complete_ns"]),
                np.where(gpu, records["gpu_end_ns"], records["complete_ns"]) > 0,
            ),
            "stream": pa.array(records["stream"].astype(np.int64)),
            "algo": _text(records["algo"]),
            "proto": _text(records["proto"]),
            "n_channels": pa.array(records["n_channels"].astype(np.int32)),
            "record_id": pa.array(records["record_seq"].astype(np.int64)),
            "source": pa.array(["archive"] * n, pa.string()),
        }
    )
    return table


def _converter() -> Any:
    try:
        from comminsight.importers import rawlog
    except ImportError:
        return None
    return getattr(rawlog, "records_to_operations", None)


def load(path: Path) -> pa.Table:
    """All segments of an archive as one conformed operations table."""
    path = Path(path)
    try:
        manifest, members = read_archive(path)
        tables = []
        convert = _converter()
        hdr_size = header.constants()["CI_LOG_HEADER_SIZE"]
        for name, data in members:
            if not name.startswith("segments/"):
                continue
            try:
                hdr = parse_header(data, Path(name))
            except SegmentError as exc:
                raise EvidenceError(f"{path}: {exc}") from exc
            records, _, _ = records_from_bytes(memoryview(data)[hdr_size:])
            if len(records) == 0:
                continue
            if convert is not None:
                try:
                    tables.append(conform(convert(records, hdr, source="archive")))
                    continue
                except TypeError:
                    pass  # a different signature than expected: use the local mapping
            tables.append(conform(records_to_table(records, hdr, manifest)))
    except ArchiveError as exc:
        raise EvidenceError(f"{path}: {exc}") from exc
    if not tables:
        return empty_table()
    return pa.concat_tables(tables)


register(Importer("archive", detect, load))
