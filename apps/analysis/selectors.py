"""Reads for analysis jobs. Everything starts from ``workloads_visible_to``: a job of a hidden workload is a 404."""

from __future__ import annotations

from django.contrib.auth.models import AnonymousUser
from django.db.models import QuerySet
from django.http import Http404
from django.shortcuts import get_object_or_404

from apps.accounts.models import User
from apps.workloads.models import Workload
from apps.workloads.selectors import workloads_visible_to

from .models import AnalysisJob, StepCalibration


def visible_workload(user: User | AnonymousUser, workload_id: int) -> Workload:
    """The workload if ``user`` may see it; else Http404 (hidden and missing look the same)."""
    return get_object_or_404(workloads_visible_to(user), pk=workload_id)


def jobs_visible_to(user: User | AnonymousUser) -> QuerySet[AnalysisJob]:
    return AnalysisJob.objects.filter(workload__in=workloads_visible_to(user)).select_related("workload", "created_by")


def workload_jobs(workload: Workload) -> QuerySet[AnalysisJob]:
    """Jobs of a workload the caller already resolved through ``visible_workload``."""
    return AnalysisJob.objects.filter(workload=workload).select_related("created_by")


def visible_job(user: User | AnonymousUser, workload_id: int, job_id: int) -> AnalysisJob:
    job = jobs_visible_to(user).filter(workload_id=workload_id, pk=job_id).first()
    if job is None:
        raise Http404("No such analysis.")
    return job


def workload_calibration(workload: Workload) -> StepCalibration | None:
    return StepCalibration.objects.filter(workload=workload).first()
