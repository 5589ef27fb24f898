"""Celery task of the analysis app: carries a job id, is idempotent, and owns its retries and time limit."""

from __future__ import annotations

from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings

from . import services

DEFER_S = 5  # how long a job waits for a free slot under the shared concurrency limit before asking again


@shared_task(
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,  # a worker killed mid-run: the message comes back and the job runs again
    soft_time_limit=settings.ANALYSIS_TASK_TIME_LIMIT_S,
    time_limit=settings.ANALYSIS_TASK_TIME_LIMIT_S + 60,
    max_retries=3,
)
def run_analysis(self, job_id: int, force: bool = False) -> str:
    """Run analysis job ``job_id`` (a done job is left alone unless ``force``); return its final state."""
    try:
        # In-process (embedded) execution has no workers to share: the limit applies to real workers.
        state = services.analysis_run(job_id, force=force, enforce_limit=not self.request.is_eager)
    except SoftTimeLimitExceeded:
        services.analysis_fail(job_id, f"stopped after {settings.ANALYSIS_TASK_TIME_LIMIT_S} s (the time limit)")
        return "failed"
    except services.RETRYABLE as exc:
        if self.request.retries >= self.max_retries:
            services.analysis_fail(job_id, f"gave up after {self.max_retries + 1} attempts: {exc}")
            return "failed"
        raise self.retry(exc=exc, countdown=min(300, 10 * 2**self.request.retries)) from exc
    if state == services.DEFERRED:
        # The site-wide limit on running analyses is reached: wait for a slot (not a failure, so no retry budget).
        raise self.retry(countdown=DEFER_S, max_retries=None)
    return state


MAP_RETRIES = 3


@shared_task(
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
    soft_time_limit=settings.ANALYSIS_TASK_TIME_LIMIT_S,
    time_limit=settings.ANALYSIS_TASK_TIME_LIMIT_S + 60,
    max_retries=MAP_RETRIES,
)
def map_partition(self, job_id: int, attempt: int, index: int) -> bool:
    """Summarise partition ``index`` of run ``attempt`` of job ``job_id`` (one map task of the job's chord).

    A failure retries this partition alone; when its retries are spent the job fails saying so.
    """
    try:
        return services.analysis_map(job_id, attempt, index)
    except SoftTimeLimitExceeded:
        services.analysis_fail(job_id, f"partition {index} stopped after {settings.ANALYSIS_TASK_TIME_LIMIT_S} s")
        return False
    except services.RETRYABLE as exc:
        if self.request.retries >= self.max_retries:
            services.analysis_fail(job_id, f"partition {index} gave up after {self.max_retries + 1} attempts: {exc}")
            return False
        raise self.retry(exc=exc, countdown=min(60, 2**self.request.retries)) from exc


@shared_task(
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
    soft_time_limit=settings.ANALYSIS_TASK_TIME_LIMIT_S,
    time_limit=settings.ANALYSIS_TASK_TIME_LIMIT_S + 60,
    max_retries=MAP_RETRIES,
)
def reduce_partitions(self, _mapped: list[bool], job_id: int, attempt: int) -> str:
    """Merge the summaries of run ``attempt`` into job ``job_id``'s result (the chord's body)."""
    try:
        return services.analysis_reduce(job_id, attempt)
    except SoftTimeLimitExceeded:
        services.analysis_fail(job_id, f"the merge stopped after {settings.ANALYSIS_TASK_TIME_LIMIT_S} s")
        return "failed"
    except services.RETRYABLE as exc:
        if self.request.retries >= self.max_retries:
            services.analysis_fail(job_id, f"the merge gave up after {self.max_retries + 1} attempts: {exc}")
            return "failed"
        raise self.retry(exc=exc, countdown=min(60, 2**self.request.retries)) from exc
