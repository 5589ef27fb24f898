"""Process-group tables (written by the import hook) and their join to communicators.

The hook (``comminsight_inject``, docs/torch-hook.md) writes one table per training process to
``<home>/metadata/process_groups-<host>-<pid>.json``: every group's name, description, global member
ranks in group-rank order, and creation order. NCCL knows none of that: the profiler sees a
communicator hash, its size, and this process's rank in it. ``name_communicators`` joins the two:

* a group is a candidate for a communicator when their sizes are equal and, for every rank the
  evidence saw on the communicator, the group holds that global rank at the same position
  (``comm_rank``), so a node that sees only some members still names cross-node groups;
* a two-rank communicator with no group of its size is PyTorch's point-to-point communicator inside
  a larger group: it is named after the smallest group holding both ranks, marked ``p2p``;
* several groups with the same member list (TP and DP of a two-GPU job) are paired with their
  communicators in creation order against first-seen order, and reported as ambiguous.

Where NCCL did get a name (PyTorch releases whose config binding has ``comm_name``: level 1), it reads
``"<group_desc>:<group_name>"`` and is split, no table needed. Every place that shows a communicator
(importers, ``comminsight analyze``, the agent's API, the site, the Perfetto export) goes through
here. A malformed, truncated, oversized or hostile table is skipped with a warning naming the file.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa

from comminsight.formats.boundedjson import JSONLimitError, loads_bounded

log = logging.getLogger("comminsight.process_groups")

FORMAT = "comminsight.process_groups"
FILE_NAME = re.compile(r"^process_groups-[A-Za-z0-9._-]{1,180}\.json$")
MAX_TABLE_BYTES = 16 << 20
MAX_GROUPS = 1 << 16
MAX_RANK = 1 << 24
MAX_TEXT = 200
METADATA_KEY = b"comminsight.names"
HOOK_HINT = "install the hook in the workload's environment: comminsight inject install --python PATH"


class TableError(ValueError):
    """A process-group table that cannot be used; the message says why."""


@dataclass(frozen=True)
class Group:
    name: str
    desc: str
    ranks: tuple[int, ...]
    creation_index: int


@dataclass
class Observation:
    """What the evidence knows of one communicator."""

    comm_id: str
    size: int = 0
    positions: dict[int, int | None] = field(default_factory=dict)  # global rank -> rank in communicator
    first_seen_ns: int = 0
    comm_name: str = ""


def _text(value: Any, what: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise TableError(f"{what} must be a string of at most {MAX_TEXT} characters")
    return value


def parse_table(data: bytes | str, origin: str = "table") -> dict[str, Any]:
    """Validate one table (bytes or text of JSON); returns it with groups normalised. Raises TableError."""
    if len(data) > MAX_TABLE_BYTES:
        raise TableError(f"{origin}: larger than {MAX_TABLE_BYTES >> 20} MiB")
    try:
        table = loads_bounded(data, what=origin, max_bytes=MAX_TABLE_BYTES)
    except JSONLimitError as exc:
        raise TableError(str(exc)) from None
    if not isinstance(table, dict) or table.get("format") != FORMAT:
        raise TableError(f"{origin}: not a process-group table (format {FORMAT!r} expected)")
    if table.get("version") != 1:
        raise TableError(f"{origin}: unsupported version {table.get('version')!r}")
    groups = table.get("groups")
    if not isinstance(groups, list) or len(groups) > MAX_GROUPS:
        raise TableError(f"{origin}: groups must be a list of at most {MAX_GROUPS}")
    clean = []
    total_ranks = 0
    for group in groups:
        if not isinstance(group, dict):
            raise TableError(f"{origin}: a group entry is not an object")
        ranks = group.get("ranks")
        if not isinstance(ranks, list) or not all(
            isinstance(r, int) and not isinstance(r, bool) and 0 <= r < MAX_RANK for r in ranks
        ):
            raise TableError(f"{origin}: group ranks must be a list of global ranks")
        if len(set(ranks)) != len(ranks):
            raise TableError(f"{origin}: group {group.get('name')!r} lists a rank twice")
        total_ranks += len(ranks)
        if total_ranks > 4 * MAX_RANK:
            raise TableError(f"{origin}: too many ranks in all groups")
        index = group.get("creation_index", 0)
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise TableError(f"{origin}: creation_index must be a non-negative integer")
        clean.append(
            {
                "name": _text(group.get("name"), "group name"),
                "desc": _text(group.get("desc"), "group desc"),
                "ranks": ranks,
                "size": len(ranks),
                "creation_index": index,
            }
        )
    level = table.get("level")
    reason = table.get("reason")
    return {
        "format": FORMAT,
        "version": 1,
        "host": _text(table.get("host"), "host") if isinstance(table.get("host"), str) else "",
        "pid": table.get("pid") if isinstance(table.get("pid"), int) else None,
        "rank": table.get("rank") if isinstance(table.get("rank"), int) else None,
        "world_size": table.get("world_size") if isinstance(table.get("world_size"), int) else None,
        "level": level if level in (1, 2, 3) else None,
        "reason": reason[: MAX_TEXT * 2] if isinstance(reason, str) else "",
        "groups": clean,
    }


def load_tables(home: Path | str) -> list[dict[str, Any]]:
    """Every usable table under ``<home>/metadata`` (or ``home`` itself when it is the metadata folder)."""
    root = Path(home)
    directory = root / "metadata" if (root / "metadata").is_dir() else root
    tables = []
    try:
        paths = sorted(p for p in directory.iterdir() if FILE_NAME.match(p.name))
    except OSError:
        return []
    for path in paths:
        try:
            if not path.is_file():
                raise TableError("not a regular file")
            if path.stat().st_size > MAX_TABLE_BYTES:
                raise TableError(f"larger than {MAX_TABLE_BYTES >> 20} MiB")
            tables.append(parse_table(path.read_bytes(), str(path)))
        except (OSError, TableError) as exc:
            log.warning("skipping process-group table %s: %s", path, exc)
    return tables


def _groups(tables: Iterable[dict[str, Any]]) -> list[Group]:
    """Distinct groups across the tables of all processes (a group's name is the same on every member)."""
    seen: dict[tuple[str, tuple[int, ...]], Group] = {}
    for table in tables:
        for g in table.get("groups", []):
            ranks = tuple(int(r) for r in g["ranks"])
            if not ranks:
                continue
            key = (str(g.get("name", "")), ranks)
            if key not in seen:
                seen[key] = Group(str(g.get("name", "")), str(g.get("desc", "")), ranks, int(g["creation_index"]))
    return sorted(seen.values(), key=lambda g: (g.creation_index, g.name))


def _split_comm_name(comm_name: str) -> tuple[str, str] | None:
    """``"<group_desc>:<group_name>"`` (level 1) -> (desc, name); None when the name is not of that shape."""
    if ":" not in comm_name:
        return None
    desc, _, name = comm_name.rpartition(":")
    return (desc, name) if desc and name else None


def _fits(group: Group, obs: Observation) -> bool:
    if obs.size and len(group.ranks) != obs.size:
        return False
    members = set(group.ranks)
    for rank, position in obs.positions.items():
        if rank not in members:
            return False
        if position is not None and 0 <= position < len(group.ranks) and group.ranks[position] != rank:
            return False
    return True


def name_communicators(observations: Iterable[Observation], tables: Iterable[dict[str, Any]]) -> dict[str, dict]:
    """``{comm_id: {"name", "desc", "ranks", "source", "note"}}`` for every communicator that can be named.

    ``source`` is ``comm_name`` (NCCL had it), ``process_groups`` (joined), ``p2p`` (point-to-point
    communicator inside a group) or ``creation_order`` (several groups had the same members).
    """
    groups = _groups(tables)
    by_rank: dict[int, list[Group]] = {}
    for g in groups:
        for r in g.ranks:
            by_rank.setdefault(r, []).append(g)
    names: dict[str, dict] = {}
    pending: dict[tuple[str, ...], list[tuple[Observation, list[Group]]]] = {}
    for obs in observations:
        parsed = _split_comm_name(obs.comm_name) if obs.comm_name else None
        if parsed:
            desc, name = parsed
            match = next((g for g in groups if g.name == name), None)
            ranks = list(match.ranks) if match else sorted(obs.positions)
            names[obs.comm_id] = {"name": name, "desc": desc, "ranks": ranks, "source": "comm_name", "note": ""}
            continue
        if not obs.positions:
            continue
        anchor = min(obs.positions)
        candidates = [g for g in by_rank.get(anchor, []) if _fits(g, obs)]
        if not candidates and obs.size == 2:
            around = [g for g in by_rank.get(anchor, []) if set(obs.positions) <= set(g.ranks) and len(g.ranks) > 2]
            if around:
                g = min(around, key=lambda g: (len(g.ranks), g.creation_index))
                names[obs.comm_id] = {
                    "name": g.name,
                    "desc": g.desc,
                    "ranks": sorted(obs.positions) if len(obs.positions) == 2 else list(g.ranks),
                    "source": "p2p",
                    "note": f"point-to-point communicator inside {g.desc or g.name}",
                }
            continue
        if candidates:
            pending.setdefault(tuple(g.name for g in candidates), []).append((obs, candidates))
    for entries in pending.values():
        candidates = entries[0][1]
        if len(candidates) == 1:
            g = candidates[0]
            for obs, _ in entries:
                names[obs.comm_id] = {
                    "name": g.name,
                    "desc": g.desc,
                    "ranks": list(g.ranks),
                    "source": "process_groups",
                    "note": "",
                }
            continue
        # The same member list grouped several times: creation order against first use.
        ordered = sorted(entries, key=lambda e: (e[0].first_seen_ns or 0, e[0].comm_id))
        descs = ", ".join(g.desc or g.name for g in candidates)
        for (obs, _), g in zip(ordered, candidates, strict=False):
            names[obs.comm_id] = {
                "name": g.name,
                "desc": g.desc,
                "ranks": list(g.ranks),
                "source": "creation_order",
                "note": f"ambiguous: {len(candidates)} groups share these members ({descs}); "
                "paired by creation order with first use",
            }
    return names


def naming_summary(
    observations: list[Observation], names: dict[str, dict], tables: list[dict[str, Any]]
) -> dict[str, Any]:
    """What a report says about names: where they came from, how many, and why some are missing."""
    total = len(observations)
    named = sum(1 for o in observations if o.comm_id in names)
    sources = sorted({n["source"] for n in names.values()})
    ambiguous = sorted({n["note"] for n in names.values() if n["source"] == "creation_order"})
    reason = ""
    if total and named < total:
        hook_reasons = sorted({t["reason"] for t in tables if t.get("level") == 3 and t.get("reason")})
        if not tables:
            reason = (
                "NCCL reported no communicator name (PyTorch without comm_name in its NCCL config) and no "
                f"process-group table (metadata/process_groups-*.json) came with the evidence: {HOOK_HINT}"
            )
        elif hook_reasons:
            reason = "the import hook could not follow group creation: " + "; ".join(hook_reasons)
        else:
            reason = (
                f"{total - named} communicator(s) match no recorded process group (different job, or tables missing)"
            )
    return {
        "communicators": total,
        "named": named,
        "sources": sources,
        "tables": len(tables),
        "ambiguous": ambiguous,
        "reason": reason,
    }


def observations_from_operations(table: pa.Table | pl.DataFrame) -> list[Observation]:
    """One observation per communicator of an operations table (vectorised; a small loop per communicator)."""
    df = table if isinstance(table, pl.DataFrame) else pl.from_arrow(table)
    assert isinstance(df, pl.DataFrame)
    if df.height == 0:
        return []
    first = pl.min_horizontal(
        pl.col("enqueue_ns").fill_null(0).replace(0, None), pl.col("start_ns").fill_null(0).replace(0, None)
    )
    per_comm = (
        df.lazy()
        .filter(pl.col("op") != "progress")
        .with_columns(first.alias("_first"))
        .group_by("comm_id")
        .agg(
            pl.col("comm_size").max().alias("size"),
            pl.col("_first").min().alias("first_seen_ns"),
            pl.col("comm_name").drop_nulls().first().alias("comm_name"),
        )
        .collect()
    )
    positions = (
        df.lazy()
        .filter((pl.col("op") != "progress") & (pl.col("rank") >= 0))
        .group_by("comm_id", "rank")
        .agg(pl.col("comm_rank").drop_nulls().first().alias("comm_rank"), pl.col("is_p2p").all().alias("p2p_only"))
        .collect()
    )
    by_comm: dict[str, dict[int, int | None]] = {}
    for comm, rank, comm_rank, _ in positions.iter_rows():
        by_comm.setdefault(comm, {})[int(rank)] = None if comm_rank is None else int(comm_rank)
    return [
        Observation(
            comm_id=comm,
            size=int(size or 0),
            positions=by_comm.get(comm, {}),
            first_seen_ns=int(first_seen or 0),
            comm_name=comm_name or "",
        )
        for comm, size, first_seen, comm_name in per_comm.iter_rows()
    ]


def apply_to_operations(table: pa.Table, tables: list[dict[str, Any]]) -> pa.Table:
    """Fill ``comm_name``/``comm_desc``/``comm_ranks`` of an operations table from the join.

    Names the evidence already carries (an FR dump's pg_desc, say) are kept. The summary for
    reports is attached as schema metadata under ``comminsight.names`` (JSON; see ``naming_of``).
    """
    observations = observations_from_operations(table)
    names = name_communicators(observations, tables)
    summary = naming_summary(observations, names, tables)
    if names:
        lookup = pl.DataFrame(
            {
                "comm_id": list(names),
                "_name": [n["name"] for n in names.values()],
                "_desc": [n["desc"] for n in names.values()],
                "_ranks": [n["ranks"] for n in names.values()],
            },
            schema={"comm_id": pl.String, "_name": pl.String, "_desc": pl.String, "_ranks": pl.List(pl.Int32)},
        )
        df = pl.from_arrow(table)
        assert isinstance(df, pl.DataFrame)
        blank_name = pl.col("comm_name").is_null() | (pl.col("comm_name") == "") | pl.col("comm_name").str.contains(":")
        blank_desc = pl.col("comm_desc").is_null() | (pl.col("comm_desc") == "")
        df = (
            df.join(lookup, on="comm_id", how="left", maintain_order="left")
            .with_columns(
                pl.when(pl.col("_name").is_not_null() & blank_name)
                .then(pl.col("_name"))
                .otherwise(pl.col("comm_name"))
                .alias("comm_name"),
                pl.when(pl.col("_desc").is_not_null() & blank_desc)
                .then(pl.col("_desc"))
                .otherwise(pl.col("comm_desc"))
                .alias("comm_desc"),
                pl.when(pl.col("comm_ranks").is_null()).then(pl.col("_ranks")).otherwise(pl.col("comm_ranks")),
            )
            .drop("_name", "_desc", "_ranks")
        )
        table = df.to_arrow().cast(table.schema)
    metadata = dict(table.schema.metadata or {})
    metadata[METADATA_KEY] = json.dumps(summary).encode()
    return table.replace_schema_metadata(metadata)


def naming_of(table: pa.Table) -> dict[str, Any] | None:
    """The naming summary ``apply_to_operations`` attached, or None."""
    raw = (table.schema.metadata or {}).get(METADATA_KEY)
    return json.loads(raw) if raw else None
