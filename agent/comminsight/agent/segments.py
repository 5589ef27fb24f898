"""Raw-log segments as the agent sees them: header validation, record reads from an offset, and orphans.

A segment (``<home>/inspector_logs/*.cilog``, renamed ``*.cilog.sealed`` when closed) is a
``ci_log_header`` followed by ``ci_op_record``'s (native/profiler/include/comminsight_ring.h). Reads
are vectorised (one ``np.frombuffer`` over the bytes), take every whole record whose magic and
checksum verify, and stop at a torn tail without failing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from comminsight.formats import header

SEALED_SUFFIX = ".sealed"
OPEN_SUFFIX = ".cilog"


class SegmentError(ValueError):
    """A segment whose header cannot be trusted; the message names the file and the reason."""


@dataclass(frozen=True)
class SegmentHeader:
    pid: int
    start_ns: int
    segment_index: int
    local_rank: int
    global_rank: int
    world_size: int
    host: str
    workload_id: str
    node_ip: str


def _text(value: np.ndarray) -> str:
    return bytes(value).split(b"\0", 1)[0].decode("utf-8", "replace")


def parse_header(raw: bytes, path: Path) -> SegmentHeader:
    """Validate and decode a segment header (the first CI_LOG_HEADER_SIZE bytes)."""
    consts = header.constants()
    size = consts["CI_LOG_HEADER_SIZE"]
    if len(raw) < size:
        raise SegmentError(f"{path}: truncated segment ({len(raw)} bytes, header needs {size})")
    hdr = np.frombuffer(raw, dtype=header.struct_dtype("ci_log_header"), count=1)[0]
    if int(hdr["magic"]) != consts["CI_LOG_MAGIC"]:
        raise SegmentError(f"{path}: bad magic 0x{int(hdr['magic']):016x}, not a CommInsight raw-log segment")
    if int(hdr["version"]) != consts["CI_FORMAT_VERSION"]:
        raise SegmentError(f"{path}: unsupported version {int(hdr['version'])}")
    if int(hdr["header_size"]) != size or int(hdr["record_size"]) != consts["CI_RECORD_SIZE"]:
        raise SegmentError(
            f"{path}: unexpected header_size/record_size {int(hdr['header_size'])}/{int(hdr['record_size'])}"
        )
    return SegmentHeader(
        pid=int(hdr["pid"]),
        start_ns=int(hdr["start_ns"]),
        segment_index=int(hdr["segment_index"]),
        local_rank=int(hdr["local_rank"]),
        global_rank=int(hdr["global_rank"]),
        world_size=int(hdr["world_size"]),
        host=_text(hdr["host"]),
        workload_id=_text(hdr["workload_id"]),
        node_ip=_text(hdr["node_ip"]),
    )


def read_header(path: Path) -> SegmentHeader:
    with open(path, "rb") as handle:
        return parse_header(handle.read(header.constants()["CI_LOG_HEADER_SIZE"]), path)


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


def read_segment(path: Path) -> tuple[SegmentHeader, np.ndarray, int]:
    """(header, valid records, corrupt count) of a whole segment."""
    raw = Path(path).read_bytes()
    hdr = parse_header(raw, path)
    records, _, corrupt = records_from_bytes(memoryview(raw)[header.constants()["CI_LOG_HEADER_SIZE"] :])
    return hdr, records, corrupt


def read_from(path: Path, offset: int, max_bytes: int) -> tuple[np.ndarray, int, int]:
    """Records of a segment from byte ``offset`` (>= header size): (valid records, new offset, corrupt).

    The new offset covers only whole records, so a record being written now is read next time.
    """
    rec_size = header.constants()["CI_RECORD_SIZE"]
    with open(path, "rb") as handle:
        handle.seek(offset)
        raw = handle.read(max_bytes - max_bytes % rec_size)
    records, whole, corrupt = records_from_bytes(raw)
    return records, offset + whole * rec_size, corrupt


def pid_alive(pid: int, proc_root: Path = Path("/proc")) -> bool:
    """Whether process ``pid`` exists (via ``proc_root``, injectable for tests)."""
    if pid <= 0:
        return False
    if proc_root != Path("/proc"):
        return (proc_root / str(pid)).exists()
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
