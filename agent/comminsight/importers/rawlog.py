"""This project's raw-log segments (``*.cilog``, ``*.cilog.sealed``) -> the operations table.

A segment is a ``ci_log_header`` followed by 256-byte ``ci_op_record``s (layout:
native/profiler/include/comminsight_ring.h, spec docs/formats/rawlog.md). Segments are read
by the profiler's own reader, ``comminsight.formats.rawlog`` (one ``np.frombuffer`` per segment);
records whose magic or checksum fail (a torn tail after a crash) are dropped, never fatal. The
records of all segments become rows through the one record decoder,
``comminsight.formats.operations``, which archives, the site and the agent use too. A path may be
a segment, a directory of segments, or a COMMINSIGHT_HOME holding ``inspector_logs/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from comminsight.importers import EvidenceError, Importer, directory_holds, evidence_files, register

if TYPE_CHECKING:
    import pyarrow as pa

    from comminsight.formats import operations

# The record modules (the C header's layout through cffi) are imported once a file is named like a
# segment: detection runs on every path an analysis reads.

NAME = "rawlog"
MAX_SEGMENT_BYTES = 8 << 30
MAX_SEGMENTS = 1_000_000
_SUFFIXES = (".cilog", ".cilog.sealed")


def _is_segment_name(path: Path) -> bool:
    return path.name.endswith(_SUFFIXES)


def _has_magic(path: Path) -> bool:
    from comminsight.formats.header import constants

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


def _read(segment: Path) -> operations.SegmentRecords:
    from comminsight.formats import operations
    from comminsight.formats import rawlog as rawlog_format

    try:
        hdr, records, _ = rawlog_format.read_segment_records(segment, max_bytes=MAX_SEGMENT_BYTES)
    except rawlog_format.RawLogError as exc:
        raise EvidenceError(f"bad segment (magic, version, sizes or length): {exc}") from exc
    except OSError as exc:
        raise EvidenceError(f"{segment}: cannot read segment: {exc}") from exc
    return operations.SegmentRecords(hdr, records)


def load(path: Path) -> pa.Table:
    """Every valid record of every segment under ``path``."""
    path = Path(path)
    if not path.exists():
        raise EvidenceError(f"{path}: no such file or directory")
    segments = _segments(path)
    if not segments:
        raise EvidenceError(f"{path}: no raw-log segments (*.cilog, *.cilog.sealed)")
    from comminsight.formats import operations

    return operations.operations([_read(segment) for segment in segments])


register(Importer(NAME, detect, load))
