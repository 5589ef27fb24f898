"""Reads for workloads. ``workloads_visible_to`` is the one place that decides who sees what.

Every page, API view, download and websocket subscription starts from it, so "not allowed" and
"does not exist" are the same 404 everywhere.
"""

from __future__ import annotations

from django.contrib.auth.models import AnonymousUser
from django.db.models import Count, Exists, OuterRef, Q, QuerySet, Subquery, Sum

from apps.accounts.models import User

from .models import Archive, ArchiveState, ShareLevel, Workload, WorkloadShare


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


def quarantined_archives_visible_to(user: User | AnonymousUser) -> QuerySet[Archive]:
    """Quarantined archives the user should hear about: their own (all of them for administrators)."""
    if not user.is_authenticated or not user.is_active:
        return Archive.objects.none()
    archives = Archive.objects.filter(state=ArchiveState.QUARANTINED).select_related("owner")
    return archives if user.is_site_admin else archives.filter(owner=user)
