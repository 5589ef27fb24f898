"""Communicator names on the site: the import hook's process-group tables joined to communicator rows.

Archives carry the tables (``metadata/process_groups-<host>-<pid>.json``, docs/formats/archive.md).
Ingest validates each (a bad one is skipped with a warning naming it; ingest goes on) and keeps the
newest version of each under ``<store>/workload-<id>/metadata/``; after every archive the join runs
again over all of the workload's tables and communicators, since a table may arrive in a later
archive than the operations it names. The join is the library's (``comminsight.evidence.process_groups``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa

from comminsight.evidence.process_groups import (
    Observation,
    TableError,
    apply_to_operations,
    load_tables,
    name_communicators,
    parse_table,
)

from .models import Communicator, Workload

logger = logging.getLogger("apps.workloads.names")


def stage_process_group_table(staging: Path, member: str, data: bytes) -> Path | None:
    """Check one archive member and stage it; None (and a warning naming it) when it is unusable."""
    try:
        parse_table(data, member)
    except TableError as exc:
        logger.warning("process-group table skipped: %s", exc)
        return None
    target = staging / "metadata" / member.removeprefix("metadata/")
    target.parent.mkdir(exist_ok=True)
    target.write_bytes(data)
    return target


def communicator_names_apply(workload: Workload, metadata_dir: Path) -> int:
    """Join the tables under ``metadata_dir`` to ``workload``'s communicator rows; returns how many are named."""
    tables = load_tables(metadata_dir)
    if not tables:
        return 0
    communicators = list(Communicator.objects.filter(workload=workload))
    observations = [
        Observation(
            comm_id=c.comm_hash,
            size=c.nranks,
            positions={int(g): int(r) for g, r in (c.positions or {}).items()} or {r: None for r in c.ranks},
            first_seen_ns=c.first_ns or 0,
            comm_name=c.comm_name,
        )
        for c in communicators
    ]
    names = name_communicators(observations, tables)
    changed = []
    for c in communicators:
        found = names.get(c.comm_hash)
        if found is None:
            continue
        values = (found["name"], found["desc"], found["ranks"], found["source"], found["note"][:300])
        if values != (c.group_name, c.group_desc, c.member_ranks, c.name_source, c.name_note):
            c.group_name, c.group_desc, c.member_ranks, c.name_source, c.name_note = values
            changed.append(c)
    Communicator.objects.bulk_update(
        changed, ["group_name", "group_desc", "member_ranks", "name_source", "name_note"], batch_size=500
    )
    return len(names)


def operations_named(table: pa.Table, metadata_dir: Path) -> pa.Table:
    """A workload's operations table with communicators named from its tables (analyses, trace export)."""
    return apply_to_operations(table, load_tables(metadata_dir))
