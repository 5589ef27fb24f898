"""Importer for sealed agent archives (``*.tar.zst`` with a ``comminsight.archive`` manifest).

Each ``segments/`` member is a raw-log segment, byte for byte; its records become operations-table
rows through the one record decoder, ``comminsight.formats.operations``, so an archive gives exactly
the rows its segments give in a home. Archives are read with
``comminsight.formats.archive.read_archive`` (streamed, capped, verified).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from comminsight.importers import EvidenceError, Importer, register

if TYPE_CHECKING:
    import pyarrow as pa

# The archive and record modules (zstandard, tarfile, the C header's layout) are imported once a
# path is an archive: detection runs on every path an analysis reads.


def detect(path: Path) -> bool:
    """A ``.tar.zst`` whose first tar member is manifest.json of kind comminsight.archive."""
    path = Path(path)
    if not path.is_file() or not path.name.endswith(".tar.zst"):
        return False
    import zstandard

    from comminsight.formats.archive import KIND

    try:
        with open(path, "rb") as handle:
            head = zstandard.ZstdDecompressor().stream_reader(handle).read(1 << 16)
    except (OSError, zstandard.ZstdError):
        return False
    return head[:13] == b"manifest.json" and f'"kind": "{KIND}"'.encode() in head


def load(path: Path) -> pa.Table:
    """All segments of an archive as one operations table (the same rows as the segments in a home give)."""
    from comminsight.formats.archive import ArchiveError, read_archive
    from comminsight.formats.operations import SegmentRecords, operations
    from comminsight.formats.rawlog import RawLogError, segment_records

    path = Path(path)
    parts = []
    try:
        _, members = read_archive(path)
        for name, data in members:
            if not name.startswith("segments/"):
                continue
            try:
                hdr, records, _ = segment_records(data, Path(name))
            except RawLogError as exc:
                raise EvidenceError(f"{path}: {exc}") from exc
            parts.append(SegmentRecords(hdr, records))
    except ArchiveError as exc:
        raise EvidenceError(f"{path}: {exc}") from exc
    return operations(parts)


register(Importer("archive", detect, load))
