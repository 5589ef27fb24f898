"""Reads for analysis jobs. Everything starts from ``workloads_visible_to``: a job of a hidden workload is a 404."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import AnonymousUser
from django.db.models import Func, IntegerField, QuerySet
from django.db.models.fields.json import KT
from django.http import Http404
from django.shortcuts import get_object_or_404

from apps.accounts.models import User
from apps.workloads.models import Workload
from apps.workloads.selectors import workloads_visible_to

from .models import AnalysisJob, AnalysisKind, JobState, StepCalibration


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


class _StepCount(Func):
    """Length of the ``steps`` array of a steps result, computed by the database (the result can be large)."""

    output_field = IntegerField()

    def __init__(self, expression: Any) -> None:
        super().__init__(expression)

    def as_sql(self, compiler: Any, connection: Any, **extra: Any) -> tuple[str, list]:
        sql, params = compiler.compile(self.source_expressions[0])
        if connection.vendor == "postgresql":
            steps = f"(({sql})::jsonb -> 'steps')"
            return f"CASE WHEN jsonb_typeof({steps}) = 'array' THEN jsonb_array_length({steps}) END", params
        return f"CASE WHEN json_type({sql}, '$.steps') = 'array' THEN json_array_length({sql}, '$.steps') END", (
            params * 2
        )


def workloads_analysis_counts(workload_ids: list[int]) -> dict[int, dict[str, Any]]:
    """Per workload: ``steps`` recovered by its newest done steps analysis and ``hang`` verdict of its newest done
    hang analysis (``None`` when not analysed). For lists: one query per kind, no result is loaded whole."""
    counts: dict[int, dict[str, Any]] = {pk: {"steps": None, "hang": None, "hang_job": None} for pk in workload_ids}
    done = AnalysisJob.objects.filter(workload_id__in=workload_ids, state=JobState.DONE).order_by("finished_at", "id")
    for workload_id, steps in done.filter(kind=AnalysisKind.STEPS).values_list("workload_id", _StepCount("result")):
        counts[workload_id]["steps"] = steps
    for workload_id, job_id, verdict in done.filter(kind=AnalysisKind.HANG).values_list(
        "workload_id", "pk", KT("result__verdict")
    ):
        counts[workload_id]["hang"] = verdict
        counts[workload_id]["hang_job"] = job_id
    return counts


def background_jobs() -> QuerySet[AnalysisJob]:
    """Analysis jobs queued, running or failed, newest first (System Settings; administrators see every one)."""
    return (
        AnalysisJob.objects.filter(state__in=[JobState.QUEUED, JobState.RUNNING, JobState.FAILED])
        .select_related("workload", "created_by")
        .order_by("-updated_at")
    )
