"""Reads for workloads. ``workloads_visible_to`` is the one place that decides who sees what.

Every page, API view, download and websocket subscription starts from it, so "not allowed" and
"does not exist" are the same 404 everywhere.
"""

from __future__ import annotations

from django.contrib.auth.models import AnonymousUser
from django.db.models import Exists, OuterRef, Q, QuerySet

from apps.accounts.models import User

from .models import ShareLevel, Workload, WorkloadShare


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
