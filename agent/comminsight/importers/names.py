"""Process-group tables that came with a piece of evidence, and the join that names its communicators.

Where the tables are: ``<home>/metadata/`` for a COMMINSIGHT_HOME (or its ``inspector_logs/``), the
``metadata/`` members of an archive (written before its segments, so reading stops there), and the
archives of a directory of archives. ``comminsight.evidence.process_groups`` does the join.
"""

from __future__ import annotations

import logging
from itertools import islice
from pathlib import Path
from typing import Any

import pyarrow as pa

from comminsight.evidence.process_groups import TableError, apply_to_operations, load_tables, parse_table

log = logging.getLogger("comminsight.importers.names")
MAX_ARCHIVES = 4096  # archives of one directory whose tables are read


def archive_tables(path: Path) -> list[dict[str, Any]]:
    """The process-group tables of one archive; a bad table is skipped with a warning naming it."""
    from comminsight.formats.archive import ArchiveError, read_archive  # tarfile, zstandard: for archives only

    tables = []
    try:
        _, members = read_archive(path)
        try:
            for name, data in members:
                if not name.startswith("metadata/"):
                    break  # tables precede the segments
                try:
                    tables.append(parse_table(data, f"{path}:{name}"))
                except TableError as exc:
                    log.warning("skipping process-group table %s", exc)
        finally:
            close = getattr(members, "close", None)
            if close is not None:
                close()
    except ArchiveError as exc:
        log.warning("%s: process-group tables unreadable: %s", path, exc)
    return tables


def evidence_tables(path: Path) -> list[dict[str, Any]]:
    """Every process-group table that belongs with the evidence at ``path``."""
    path = Path(path)
    beside_a_file = path.is_file()
    if beside_a_file:
        if path.name.endswith(".tar.zst"):
            return archive_tables(path)
        path = path.parent
    if not path.is_dir():
        return []
    tables = load_tables(path)
    if path.name == "inspector_logs":
        tables += load_tables(path.parent)
    # a directory given is searched whole; a file's own folder only (a trace in /tmp or ~ must not walk it)
    found = path.glob("*.tar.zst") if beside_a_file else path.rglob("*.tar.zst")
    archives = sorted(islice((p for p in found if p.is_file()), MAX_ARCHIVES))
    for archive in archives:
        tables += archive_tables(archive)
    return tables


def with_names(table: pa.Table, path: Path) -> pa.Table:
    """``table`` with communicators named from the tables found with ``path`` (summary in its metadata)."""
    return apply_to_operations(table, evidence_tables(path))
