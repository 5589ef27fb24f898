"""Celery tasks of the analysis app: they carry job ids, are idempotent, and own their retries and time limit.

``run_analysis`` runs a job (or, for a partitioned analysis, plans it and queues its chord);
``map_partition`` and ``reduce_partitions`` are the chord's tasks (``apps.analysis.partitions``).
"""

from __future__ import annotations

from typing import Any

from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings

from . import services

DEFER_S = 5  # how long a job waits for a free slot under the shared concurrency limit before asking again
MAP_RETRIES = 3

TASK_OPTIONS: dict[str, Any] = {
    "bind": True,
    "acks_late": True,
    "reject_on_worker_lost": True,  # a worker killed mid-run: the message comes back and the task runs again
    "soft_time_limit": settings.ANALYSIS_TASK_TIME_LIMIT_S,
    "time_limit": settings.ANALYSIS_TASK_TIME_LIMIT_S + 60,
    "max_retries": MAP_RETRIES,
}


def _retry_or_fail(task: Any, job_id: int, exc: Exception, what: str, delays_s: tuple[int, int]) -> None:
    """Retry ``task`` after an infrastructure error (``services.RETRYABLE``), waiting ``delays_s[0]`` doubled per
    retry up to ``delays_s[1]``; its retries spent, fail the job saying what gave up (``what``: "", "partition 3 ",
    "the merge ")."""
    if task.request.retries >= task.max_retries:
        services.analysis_fail(job_id, f"{what}gave up after {task.max_retries + 1} attempts: {exc}")
        return
    first, cap = delays_s
    raise task.retry(exc=exc, countdown=min(cap, first * 2**task.request.retries)) from exc


def _timed_out(job_id: int, what: str) -> None:
    services.analysis_fail(job_id, f"{what}stopped after {settings.ANALYSIS_TASK_TIME_LIMIT_S} s (the time limit)")


@shared_task(**TASK_OPTIONS)
def run_analysis(self, job_id: int, force: bool = False) -> str:
    """Run analysis job ``job_id`` (a done job is left alone unless ``force``); return its final state."""
    try:
        # In-process (embedded) execution has no workers to share: the limit applies to real workers.
        state = services.analysis_run(job_id, force=force, enforce_limit=not self.request.is_eager)
    except SoftTimeLimitExceeded:
        _timed_out(job_id, "")
        return "failed"
    except services.RETRYABLE as exc:
        _retry_or_fail(self, job_id, exc, "", delays_s=(10, 300))
        return "failed"
    if state == services.DEFERRED:
        # The site-wide limit on running analyses is reached: wait for a slot (not a failure, so no retry budget).
        raise self.retry(countdown=DEFER_S, max_retries=None)
    return state


@shared_task(**TASK_OPTIONS)
def map_partition(self, job_id: int, attempt: int, index: int, stage: int = 1) -> bool:
    """Summarise partition ``index`` for ``stage`` of run ``attempt`` of job ``job_id`` (a map task of its chord).

    A failure retries this partition alone; when its retries are spent the job fails saying so.
    """
    try:
        return services.analysis_map(job_id, attempt, index, stage)
    except SoftTimeLimitExceeded:
        _timed_out(job_id, f"partition {index} ")
        return False
    except services.RETRYABLE as exc:
        _retry_or_fail(self, job_id, exc, f"partition {index} ", delays_s=(1, 60))
        return False


@shared_task(**TASK_OPTIONS)
def reduce_partitions(self, _mapped: list[bool], job_id: int, attempt: int, stage: int = 1) -> str:
    """Merge the summaries of ``stage`` of run ``attempt`` (the chord's body): job ``job_id``'s result, or the
    next stage's chord."""
    try:
        return services.analysis_reduce(job_id, attempt, stage)
    except SoftTimeLimitExceeded:
        _timed_out(job_id, "the merge ")
        return "failed"
    except services.RETRYABLE as exc:
        _retry_or_fail(self, job_id, exc, "the merge ", delays_s=(1, 60))
        return "failed"
