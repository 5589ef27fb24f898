"""Reads for workloads. ``workloads_visible_to`` is the one place that decides who sees what.

Every page, API view, download and websocket subscription starts from it, so "not allowed" and
"does not exist" are the same 404 everywhere.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

from django.contrib.auth.models import AnonymousUser
from django.db.models import Count, Exists, OuterRef, Q, QuerySet, Subquery, Sum

from apps.accounts.models import User

from .models import Archive, ArchiveSource, ArchiveState, Communicator, ShareLevel, Workload, WorkloadShare

_DIMENSION = re.compile(r"^(tp|pp|dp|cp|ep|mp)[-_]?(\d*)$", re.IGNORECASE)


def workloads_visible_to(user: User | AnonymousUser) -> QuerySet[Workload]:
    """Workloads ``user`` may see: all for root and administrators; own and shared ones for others."""
    if not user.is_authenticated or not user.is_active:
        return Workload.objects.none()
    workloads = Workload.objects.select_related("owner")
    if user.is_site_admin:
        return workloads.all()
    shared = WorkloadShare.objects.filter(workload=OuterRef("pk"), user=user)
    return workloads.filter(Q(owner=user) | Exists(shared))


def workloads_manageable_by(user: User | AnonymousUser) -> QuerySet[Workload]:
    """Workloads ``user`` may share, unshare and delete: own, shared with ``manage``, or any for admins."""
    if not user.is_authenticated or not user.is_active:
        return Workload.objects.none()
    if user.is_site_admin:
        return Workload.objects.all()
    managed = WorkloadShare.objects.filter(workload=OuterRef("pk"), user=user, level=ShareLevel.MANAGE)
    return Workload.objects.filter(Q(owner=user) | Exists(managed))


def workload_can_manage(user: User | AnonymousUser, workload: Workload) -> bool:
    return workloads_manageable_by(user).filter(pk=workload.pk).exists()


def workloads_with_counts(workloads: QuerySet[Workload]) -> QuerySet[Workload]:
    """Annotate nodes, ranks and archives per workload for lists (one query)."""
    # Archive bytes come from a subquery: summing across the joins above would multiply them.
    archive_bytes = (
        Archive.objects.filter(workload=OuterRef("pk")).values("workload").annotate(total=Sum("size")).values("total")
    )
    return workloads.annotate(
        node_count=Count("nodes", distinct=True),
        rank_count=Count("ranks", distinct=True),
        archive_count=Count("archives", distinct=True),
        archive_bytes=Subquery(archive_bytes),
    )


def archives_visible_to(user: User | AnonymousUser) -> QuerySet[Archive]:
    """Archives ``user`` may see: their own (whatever their state) and those of workloads they may see."""
    if not user.is_authenticated or not user.is_active:
        return Archive.objects.none()
    if user.is_site_admin:
        return Archive.objects.all()
    return Archive.objects.filter(Q(owner=user) | Q(workload__in=workloads_visible_to(user).values("pk")))


def troubled_archives_visible_to(user: User | AnonymousUser) -> QuerySet[Archive]:
    """Archives the user should hear about: quarantined ones and those waiting after a failed attempt (the
    reason says why); their own, all of them for administrators."""
    if not user.is_authenticated or not user.is_active:
        return Archive.objects.none()
    troubled = Q(state=ArchiveState.QUARANTINED) | (Q(state=ArchiveState.STORED) & ~Q(reason=""))
    archives = Archive.objects.filter(troubled).select_related("owner")
    return archives if user.is_site_admin else archives.filter(owner=user)


@dataclass(frozen=True)
class BackgroundTask:
    """One queued, running or failed piece of background work the site started (System Settings)."""

    kind: str  # "analysis" or "ingest"
    pk: int  # the AnalysisJob's or the Archive's
    title: str  # "Hang analysis", "Ingest (upload)", "Ingest (discovered)"
    subject: str  # the workload's name, or the archive's file name
    workload_id: int | None
    state: str  # "queued", "running" or "failed"
    reason: str  # why it failed, or why a queued ingest waits for a retry
    created_at: datetime
    owner: str  # who asked for the analysis, whose archive it is

    @property
    def cancellable(self) -> bool:
        return self.state == "queued" or (self.kind == "analysis" and self.state == "running")

    @property
    def requeueable(self) -> bool:
        """A quarantined (or cancelled) ingest; whether its bytes are still there is checked when asked."""
        return self.kind == "ingest" and self.state == "failed"


def background_tasks(limit: int = 200) -> list[BackgroundTask]:
    """Every queued, running or failed background task the site started, newest first, read from the database
    (not from the broker): analysis jobs, and archive ingests — uploaded or found by discovery — waiting
    (``queued``; after a failed attempt the reason says why), held by an attempt (``running``) or quarantined
    (``failed``). For administrators only (the caller checks)."""
    from apps.analysis.selectors import background_jobs  # apps.analysis reads workloads: imported when used

    tasks = [
        BackgroundTask(
            kind="analysis",
            pk=job.pk,
            title=f"{job.get_kind_display()} analysis",
            subject=job.workload.name,
            workload_id=job.workload_id,
            state=job.state,
            reason=job.error,
            created_at=job.created_at,
            owner=job.created_by.username if job.created_by else "",
        )
        for job in background_jobs()[:limit]
    ]
    archives = Archive.objects.filter(state__in=[ArchiveState.STORED, ArchiveState.QUARANTINED])
    for archive in archives.select_related("owner", "workload").order_by("-created_at")[:limit]:
        if archive.state == ArchiveState.QUARANTINED:
            state = "failed"
        else:
            state = "running" if archive.lease_owner else "queued"
        tasks.append(
            BackgroundTask(
                kind="ingest",
                pk=archive.pk,
                title=f"Ingest ({'discovered' if archive.source == ArchiveSource.DISCOVERY else 'upload'})",
                subject=archive.filename,
                workload_id=archive.workload_id,
                state=state,
                reason=archive.reason,
                created_at=archive.created_at,
                owner=archive.owner.username,
            )
        )
    tasks.sort(key=lambda task: task.created_at, reverse=True)
    return tasks[:limit]


def workload_rank_coordinates(communicators: list[Communicator]) -> dict[int, dict[str, tuple[int, int]]]:
    """Per global rank, its (group, index in group) for every named parallel dimension, from communicator names.

    Megatron-style names (``tp0``, ``dp3``, ``pp1`` …, the simulator's and torch's group names) give the
    dimension; the member list gives the index. Unnamed communicators give nothing (coordinates unknown).
    """
    coordinates: dict[int, dict[str, tuple[int, int]]] = {}
    for communicator in communicators:
        match = _DIMENSION.match(communicator.comm_name or "")
        if not match or not communicator.ranks:
            continue
        dimension, group = match.group(1).lower(), int(match.group(2) or 0)
        for index, rank in enumerate(sorted(communicator.ranks)):
            coordinates.setdefault(int(rank), {})[dimension] = (group, index)
    return coordinates


def workload_nccl_facts(parquet_files: list) -> list[dict]:
    """NCCL's algorithm, protocol and channels per communicator, as the profiler recorded them (empty if none).

    Reads four columns of the columnar store lazily; the answer has one row per (communicator, algo, proto).
    """
    import polars as pl

    if not parquet_files:
        return []
    from comminsight.evidence.schema import SCHEMA
    from comminsight_site.objectstore import ObjectStoreError, object_store

    try:
        columns = ["comm_id", "algo", "proto", "n_channels"]
        table = object_store().dataset(list(parquet_files), schema=SCHEMA).to_table(columns=columns)
        frame = (
            pl.from_arrow(table)
            .lazy()
            .filter(pl.col("algo").is_not_null() | pl.col("n_channels").is_not_null())
            .group_by("comm_id", "algo", "proto")
            .agg(pl.len().alias("ops"), pl.col("n_channels").max().alias("max_channels"))
            .sort("comm_id", "ops", descending=[False, True])
            .collect()
        )
    except (pl.exceptions.PolarsError, OSError, ObjectStoreError):
        return []
    return frame.head(1000).to_dicts()
