"""State changes for workloads: sharing, unsharing, deletion (the caller has already checked visibility),
and the operator actions behind ``manage.py purge`` and ``manage.py import_evidence``."""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from django.db import transaction
from django.db.models import Count
from django.db.models.functions import Coalesce, Greatest
from django.utils import timezone

from apps.accounts.models import User
from comminsight.evidence.schema import conform

from .ingest import ManifestFacts, archive_quarantined_requeue, archive_queued_cancel
from .models import Archive, ArchiveSource, ShareLevel, Workload, WorkloadShare
from .selectors import workload_can_manage

logger = logging.getLogger(__name__)

# An evidence directory is one file per rank or a few per process; far more means the wrong directory.
MAX_IMPORT_FILES = 65536


class WorkloadPermissionDenied(Exception):
    """The user sees the workload but may not change it (answers 403, not 404)."""


class WorkloadError(Exception):
    """A refused change; the message is safe to show."""


def _require_manage(actor: User, workload: Workload) -> None:
    if not workload_can_manage(actor, workload):
        raise WorkloadPermissionDenied("You need the manage level on this workload (or to be an administrator).")


def workload_share(*, actor: User, workload: Workload, user: User, level: str = ShareLevel.READ) -> WorkloadShare:
    """Share ``workload`` with ``user`` at ``level`` (re-sharing changes the level)."""
    _require_manage(actor, workload)
    if level not in ShareLevel.values:
        raise WorkloadError(f"Level must be one of {', '.join(ShareLevel.values)}.")
    if user.pk == workload.owner_id:
        raise WorkloadError("The owner already sees this workload.")
    if not user.is_active:
        raise WorkloadError("That user is deactivated.")
    share, _ = WorkloadShare.objects.update_or_create(workload=workload, user=user, defaults={"level": level})
    logger.info("%s shared workload %s with %s (%s)", actor.username, workload.pk, user.username, level)
    return share


def workload_unshare(*, actor: User, workload: Workload, user: User) -> bool:
    """Remove ``user``'s share; True when there was one."""
    _require_manage(actor, workload)
    deleted, _ = WorkloadShare.objects.filter(workload=workload, user=user).delete()
    return bool(deleted)


def workload_delete(*, actor: User, workload: Workload) -> None:
    """Delete a workload the actor may manage (see ``workload_remove`` for what goes with it)."""
    _require_manage(actor, workload)
    workload_remove(workload, by=actor.username)


def archive_ingest_cancel(*, actor: User, archive: Archive) -> bool:
    """Administrators cancel an archive's queued ingest (System Settings): it is quarantined with the reason
    "Ingest cancelled by <administrator>." and no worker ingests it. False when it was not waiting for ingest."""
    if not actor.is_site_admin:
        raise WorkloadPermissionDenied("Only administrators cancel background jobs.")
    return archive_queued_cancel(archive.pk, actor.username)


def archive_ingest_requeue(*, actor: User, archive: Archive) -> bool:
    """Administrators put a quarantined or cancelled archive back in the ingest queue (System Settings, API),
    recorded as theirs. True when queued now, False when it was already waiting; raises ``RequeueRefused``
    (ingested, or its stored bytes are gone)."""
    if not actor.is_site_admin:
        raise WorkloadPermissionDenied("Only administrators re-queue an ingest.")
    return archive_quarantined_requeue(archive.pk, actor.username)


def workload_remove(workload: Workload, *, by: str) -> None:
    """Delete a workload with its archives (rows and uploaded bytes), analysis results and columnar store.

    The one deletion path: the API's delete and ``manage.py purge`` both end here. Discovered archive
    files are left where they were found: the shared path is not the site's. Files go only after the
    rows are gone for good (on commit); analysis jobs cascade, their trace exports go by signal.
    """
    from comminsight_site.objectstore import object_store

    from .ingest import store_prefix

    workload_id = workload.pk
    with transaction.atomic():
        uploaded = list(workload.archives.filter(source=ArchiveSource.UPLOAD).values_list("path", flat=True))
        workload.delete()

        def remove_files() -> None:
            store = object_store()
            store.delete_prefix(store_prefix(workload_id))
            for location in uploaded:
                if not Archive.objects.filter(path=location).exists():  # no other owner's archive of these bytes
                    store.delete(location)

        transaction.on_commit(remove_files)
    logger.info("%s deleted workload %s", by, workload_id)


# --- Operator actions (manage.py purge, manage.py import_evidence) ----------------------------------------------


@dataclass(frozen=True)
class PurgeCandidate:
    workload_id: int
    name: str
    owner: str
    last_activity: datetime
    archives: int
    store_bytes: int


def _store_bytes(workload_id: int) -> int:
    from comminsight_site.objectstore import object_store

    from .ingest import store_prefix

    return object_store().total_bytes(store_prefix(workload_id))


def workloads_purge(
    *, workload_ids: list[int] | None = None, older_than_days: float | None = None, dry_run: bool = True
) -> list[PurgeCandidate]:
    """Delete the workloads matching exactly one selector (ids, or idle longer than ``older_than_days``).

    Returns what matched (and, unless ``dry_run``, was deleted through ``workload_remove``). Raises
    WorkloadError for a bad selector or an unknown id, before anything is deleted.
    """
    if (workload_ids is None) == (older_than_days is None):
        raise WorkloadError("Choose the workloads: give workload ids or an age in days (one of them).")
    if workload_ids is not None:
        matched = Workload.objects.filter(pk__in=workload_ids)
        missing = set(workload_ids) - set(matched.values_list("pk", flat=True))
        if missing:
            raise WorkloadError(f"No workload with id {', '.join(map(str, sorted(missing)))}.")
    else:
        if not 0 <= older_than_days < 100_000:  # type: ignore[operator]
            raise WorkloadError("The age must be a number of days between 0 and 100000.")
        cutoff = timezone.now() - timedelta(days=older_than_days)  # type: ignore[arg-type]
        # Last activity: the newest of ingest/heartbeat (last_seen_at) and any change to the row.
        matched = Workload.objects.annotate(
            activity=Greatest(Coalesce("last_seen_at", "created_at"), "updated_at")
        ).filter(activity__lt=cutoff)
    matched = matched.select_related("owner").annotate(archive_count=Count("archives")).order_by("pk")
    candidates = [
        PurgeCandidate(
            workload_id=w.pk,
            name=w.name,
            owner=w.owner.username,
            last_activity=max(w.last_seen_at or w.created_at, w.updated_at),
            archives=w.archive_count,
            store_bytes=_store_bytes(w.pk),
        )
        for w in matched
    ]
    if not dry_run:
        for workload in Workload.objects.filter(pk__in=[c.workload_id for c in candidates]).order_by("pk"):
            workload_remove(workload, by="manage.py purge")
    return candidates


@dataclass(frozen=True)
class EvidenceImport:
    workload: Workload
    created: bool  # the workload was new
    importer: str
    rows: int
    ranks: int
    nodes: list[str]
    files: list[Path]


def _evidence_identity(path: Path) -> str:
    """sha256 over the evidence's bytes (a file, or a directory's regular files with their names).

    Names the Parquet files, so importing the same evidence again replaces its own output.
    """
    from .uploads import file_sha256

    if path.is_file():
        return file_sha256(path)
    digest = hashlib.sha256()
    for index, member in enumerate(sorted(path.rglob("*"))):
        if index > MAX_IMPORT_FILES:
            raise WorkloadError(f"{path}: more than {MAX_IMPORT_FILES} files; import a smaller directory")
        if member.is_file() and not member.is_symlink():
            digest.update(f"{member.relative_to(path)}\0{file_sha256(member)}\n".encode())
    return digest.hexdigest()


def _node_facts(table: pa.Table, node: str, first_ns: int | None, last_ns: int | None) -> ManifestFacts:
    """A node's ranks and communicators from its rows of the operations table (what a manifest would say)."""
    frame = pl.from_arrow(table.select(["host", "rank", "comm_id", "comm_name", "comm_size"]))
    assert isinstance(frame, pl.DataFrame)
    ranks = sorted(r for r in frame["rank"].unique().to_list() if r >= 0)
    comms = (
        frame.filter(pl.col("rank") >= 0)
        .group_by("comm_id")
        .agg(
            pl.col("comm_name").drop_nulls().first(),
            pl.col("comm_size").max(),
            pl.col("rank").unique().sort(),
        )
        .sort("comm_id")
    )
    communicators = [
        {
            "comm_hash": row["comm_id"],
            "comm_name": (row["comm_name"] or "")[:200],
            "nranks": max(int(row["comm_size"] or 0), 0),
            "ranks": row["rank"],
        }
        # The communicator table keys on the hash (18 chars); longer ids (process-group names) stay in Parquet only.
        for row in comms.iter_rows(named=True)
        if row["comm_id"] and len(row["comm_id"]) <= 18
    ]
    hosts = frame["host"].drop_nulls().unique().to_list()
    return ManifestFacts(
        workload_id="",
        node=node,
        host=hosts[0][:200] if len(hosts) == 1 else "",
        node_ip="",
        first_ns=first_ns,
        last_ns=last_ns,
        ranks=ranks,
        communicators=communicators,
        record_count=table.num_rows,
    )


def _time_range(table: pa.Table) -> tuple[int | None, int | None]:
    lows = [pc.min(table[c]).as_py() for c in ("enqueue_ns", "start_ns", "end_ns")]
    highs = [pc.max(table[c]).as_py() for c in ("enqueue_ns", "start_ns", "end_ns")]
    lows = [v for v in lows if v is not None and v >= 0]
    highs = [v for v in highs if v is not None and v >= 0]
    return (min(lows) if lows else None, max(highs) if highs else None)


def evidence_import(*, path: Path, workload_name: str, owner: User, fmt: str | None = None) -> EvidenceImport:
    """Import external evidence (anything ``comminsight.importers`` reads) into the owner's workload.

    The workload (external id ``workload_name``) is created when the owner has none; one of that name
    held only by another owner is refused. Rows go into the same store layout as archive ingest
    (``workload-<pk>/node-<node>/rank-<rank>/import-<sha256>.parquet``), staged first and moved into
    place after the metadata rows are written; any error leaves the store and the database as they were.
    Raises WorkloadError (the message is safe to show).
    """
    from comminsight.importers import EvidenceError, detect, load
    from comminsight_site.objectstore import object_store

    from .ingest import path_part, store_dir, store_prefix, workload_facts_apply

    name = workload_name.strip()
    if not name or len(name) > 200:
        raise WorkloadError("The workload name must be 1 to 200 characters.")
    if not owner.is_active:
        raise WorkloadError(f"User {owner.username} is deactivated.")
    existing = Workload.objects.filter(owner=owner, external_id=name).first()
    if existing is None and Workload.objects.filter(external_id=name).exists():
        raise WorkloadError(f"Workload {name!r} belongs to another user; import into it as its owner.")
    path = Path(path)
    try:
        importer = fmt or detect(path).name
        table = conform(load(path, importer))
        identity = _evidence_identity(path)
    except (EvidenceError, ValueError) as exc:
        raise WorkloadError(f"Cannot import {path}: {exc}") from exc
    except OSError as exc:
        raise WorkloadError(f"Cannot read {path}: {exc.strerror or exc}") from exc
    if table.num_rows == 0:
        raise WorkloadError(f"{path} holds no operations; nothing imported.")

    # Partition keys: the node (else the host, else "unknown") and the global rank, computed once, vectorised.
    node_column = pc.coalesce(
        pc.if_else(pc.equal(table["node"], ""), None, table["node"]),
        pc.if_else(pc.equal(table["host"], ""), None, table["host"]),
        pa.scalar("unknown"),
    )
    keys = pl.DataFrame({"node": pl.from_arrow(node_column), "rank": pl.from_arrow(table["rank"])}).with_row_index()
    first_ns, last_ns = _time_range(table)
    staging_root = store_dir() / ".staging"
    staging_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"import-{identity[:16]}-", dir=staging_root))
    try:
        staged: list[tuple[str, int, Path]] = []
        for (node, rank), group in keys.group_by(["node", "rank"], maintain_order=True):
            part = table.take(group["index"].to_arrow())
            source = staging / f"{len(staged)}.parquet"
            pq.write_table(part, source, compression="zstd")
            staged.append((str(node), int(rank), source))
        nodes = sorted({node for node, _, _ in staged})
        with transaction.atomic():
            workload, created = (existing, False) if existing else (None, True)
            if workload is None:
                workload = Workload.objects.create(owner=owner, external_id=name, name=name)
            for node in nodes:
                rows = table.filter(pc.equal(node_column, node))
                workload_facts_apply(workload, _node_facts(rows, node, first_ns, last_ns))
            published = []
            store = object_store()
            for node, rank, source in staged:
                key = f"{store_prefix(workload.pk)}/node-{path_part(node)}/rank-{rank}/import-{identity}.parquet"
                published.append(store.put_file(source, key))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("imported %d %s rows from %s into workload %s", table.num_rows, importer, path, workload.pk)
    return EvidenceImport(
        workload=workload,
        created=created,
        importer=importer,
        rows=table.num_rows,
        ranks=len({rank for _, rank, _ in staged if rank >= 0}),
        nodes=nodes,
        files=published,
    )
