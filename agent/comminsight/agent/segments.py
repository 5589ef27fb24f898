"""Raw-log segments as the agent sees them: whole reads and record reads from an offset.

A segment (``<home>/inspector_logs/*.cilog``, renamed ``*.cilog.sealed`` when closed) is a
``ci_log_header`` followed by ``ci_op_record``'s (native/profiler/include/comminsight_ring.h). Reads
are vectorised (one ``np.frombuffer`` over the bytes), take every whole record whose magic and
checksum verify, and stop at a torn tail without failing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from comminsight.formats import header
from comminsight.formats.rawlog import RawLogError, SegmentHeader, parse_header, records_from_bytes, segment_records

__all__ = [
    "OPEN_SUFFIX",
    "SEALED_SUFFIX",
    "SegmentError",
    "SegmentHeader",
    "parse_header",
    "read_from",
    "read_header",
    "read_segment",
    "records_from_bytes",
]

SEALED_SUFFIX = ".sealed"
OPEN_SUFFIX = ".cilog"


# Header parsing and record extraction belong to the format (comminsight.formats.rawlog); the agent
# adds reading from an offset while a segment grows.
SegmentError = RawLogError


def read_header(path: Path) -> SegmentHeader:
    with open(path, "rb") as handle:
        return parse_header(handle.read(header.constants()["CI_LOG_HEADER_SIZE"]), path)


def read_segment(path: Path) -> tuple[SegmentHeader, np.ndarray, int]:
    """(header, valid records, corrupt count) of a whole segment."""
    return segment_records(Path(path).read_bytes(), Path(path))


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
