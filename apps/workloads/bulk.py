"""Bulk writes of what ingest learns about a workload: its ranks and communicators.

One archive may name thousands of ranks or communicators, and several archives of one workload are ingested
at once (one per node). Each function here writes all its rows with a fixed number of statements and in key
order — so two archives that touch the same rows lock them in the same order (no deadlock) and for the few
milliseconds of one statement, inside the caller's short transaction.

On PostgreSQL the merge happens in the database (``INSERT … SELECT FROM jsonb_to_recordset … ON CONFLICT DO
UPDATE``): the rows travel as one JSON parameter and no model instance is built — the ORM's own bulk paths
spend seconds per 20,000 rows in Python. Other databases (SQLite, the embedded mode) take the ORM path,
which is correct but slower.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from django.db import connection

from .models import Communicator, Node, Rank, Workload

BATCH = 1000  # rows per statement on the ORM path
# Communicator columns the merge writes; every other column takes the model field's default on insert.
MERGED = ("comm_hash", "comm_name", "nranks", "ranks", "positions", "first_ns")


def ranks_upsert(workload: Workload, node: Node, ranks: list[int]) -> None:
    """Record ``ranks`` as the workload's, on ``node`` (a rank seen again moves to this node)."""
    ranks = sorted(set(ranks))
    if not ranks:
        return
    if connection.vendor == "postgresql":
        table = Rank._meta.db_table
        with connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {table} (workload_id, node_id, rank) "  # noqa: S608 (names from the model)
                "SELECT %s, %s, r FROM unnest(%s::integer[]) AS r ORDER BY r "
                "ON CONFLICT (workload_id, rank) DO UPDATE SET node_id = EXCLUDED.node_id",
                [workload.pk, node.pk, ranks],
            )
        return
    Rank.objects.bulk_create(
        [Rank(workload=workload, node=node, rank=rank) for rank in ranks],
        update_conflicts=True,
        unique_fields=["workload", "rank"],
        update_fields=["node"],
        batch_size=BATCH,
    )


def communicators_merge(workload: Workload, communicators: list[dict[str, Any]]) -> None:
    """Insert new communicators and merge into known ones: members united, the larger size, the first name,
    positions added, the earliest first operation. ``communicators`` are dicts with the ``MERGED`` keys."""
    incoming = {comm["comm_hash"]: comm for comm in communicators}
    if not incoming:
        return
    rows = [
        {
            "comm_hash": key,
            "comm_name": incoming[key].get("comm_name", ""),
            "nranks": incoming[key].get("nranks", 0),
            "ranks": sorted(set(incoming[key].get("ranks", []))),
            "positions": incoming[key].get("positions") or {},
            "first_ns": incoming[key].get("first_ns") or None,
        }
        for key in sorted(incoming)
    ]
    if connection.vendor == "postgresql":
        _merge_postgresql(workload, rows)
    else:
        _merge_orm(workload, rows)


def _merge_postgresql(workload: Workload, rows: list[dict[str, Any]]) -> None:
    table = Communicator._meta.db_table
    defaults = [
        field
        for field in Communicator._meta.concrete_fields
        if not field.primary_key and field.name != "workload" and field.name not in MERGED
    ]
    columns = ", ".join(["workload_id", *MERGED, *(field.column for field in defaults)])
    default_values = [field.get_db_prep_save(field.get_default(), connection) for field in defaults]
    placeholders = ", ".join(["%s"] * len(defaults))
    merged = (
        "ranks = (SELECT COALESCE(jsonb_agg(DISTINCT member ORDER BY member), '[]'::jsonb) "  # noqa: S608
        f"FROM jsonb_array_elements({table}.ranks || EXCLUDED.ranks) AS member), "
        f"nranks = GREATEST({table}.nranks, EXCLUDED.nranks), "
        f"comm_name = COALESCE(NULLIF({table}.comm_name, ''), EXCLUDED.comm_name), "
        f"positions = {table}.positions || EXCLUDED.positions, "
        f"first_ns = LEAST({table}.first_ns, EXCLUDED.first_ns)"  # LEAST ignores NULL
    )
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} ({columns}) "  # noqa: S608 (table and column names from the model)
            f"SELECT %s, v.comm_hash, v.comm_name, v.nranks, v.ranks, v.positions, v.first_ns"
            f"{', ' if defaults else ''}{placeholders} "
            "FROM jsonb_to_recordset(%s::jsonb) AS v(comm_hash text, comm_name text, nranks integer, ranks jsonb, "
            "positions jsonb, first_ns bigint) ORDER BY v.comm_hash "
            f"ON CONFLICT (workload_id, comm_hash) DO UPDATE SET {merged}",
            [workload.pk, *default_values, json.dumps(rows)],
        )


def _merge_orm(workload: Workload, rows: list[dict[str, Any]]) -> None:
    incoming = {row["comm_hash"]: row for row in rows}
    Communicator.objects.bulk_create(
        [Communicator(workload=workload, **row) for row in rows],
        ignore_conflicts=True,  # rows that already existed are merged below, under their lock
        batch_size=BATCH,
    )
    changed = []
    locked = Communicator.objects.select_for_update().filter(workload=workload).order_by("comm_hash")
    for keys in _batches(sorted(incoming), BATCH):
        for row in locked.filter(comm_hash__in=keys):
            comm = incoming[row.comm_hash]
            before = (row.ranks, row.nranks, row.comm_name, row.positions, row.first_ns)
            row.ranks = sorted(set(row.ranks) | set(comm["ranks"]))
            row.nranks = max(row.nranks, comm["nranks"])
            row.comm_name = row.comm_name or comm["comm_name"]
            row.positions = {**row.positions, **comm["positions"]}
            if comm["first_ns"]:
                row.first_ns = min(row.first_ns or comm["first_ns"], comm["first_ns"])
            if (row.ranks, row.nranks, row.comm_name, row.positions, row.first_ns) != before:
                changed.append(row)
    Communicator.objects.bulk_update(
        changed, ["ranks", "nranks", "comm_name", "positions", "first_ns"], batch_size=BATCH
    )


def _batches(items: list[str], size: int) -> Iterator[list[str]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
