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
