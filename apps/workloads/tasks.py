"""Celery tasks of the workloads app. Each carries ids, is safe to run twice, and owns its retry policy."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings
from django.db import InterfaceError, OperationalError

from . import discovery, ingest, live, uploads


@shared_task(
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
    soft_time_limit=settings.INGEST_TASK_TIME_LIMIT_S,
    time_limit=settings.INGEST_TASK_TIME_LIMIT_S + 60,
    autoretry_for=(OperationalError, InterfaceError, OSError),
    retry_backoff=True,
    retry_backoff_max=300,
    max_retries=5,
)
def ingest_archive(self, archive_id: int) -> str:
    """Verify and normalise one stored archive (idempotent per sha256: a finished archive is left alone)."""
    return ingest.archive_ingest(archive_id)


@shared_task(acks_late=True, soft_time_limit=600, time_limit=660)
def discover_archives() -> int:
    """Scan ``<archive path>/comminsight/02_archives`` for new archives; return how many were registered."""
    return discovery.discover_archives()


@shared_task(soft_time_limit=60, time_limit=90)
def mark_lost_workloads() -> int:
    """Mark running/hung workloads whose agents went silent as lost."""
    return live.mark_lost_workloads()


@shared_task(soft_time_limit=60, time_limit=90)
def requeue_stale_archives() -> int:
    """Queue ingest again for archives stored long ago and still not ingested (nothing is lost)."""
    ids = ingest.stale_stored_archives()
    for archive_id in ids:
        ingest_archive.delay(archive_id)
    return len(ids)


@shared_task(soft_time_limit=300, time_limit=360)
def expire_abandoned_uploads() -> int:
    """Remove open uploads idle for a week (bytes and rows)."""
    return uploads.uploads_expire()


@shared_task(soft_time_limit=60, time_limit=90, autoretry_for=(OperationalError, InterfaceError), max_retries=3)
def merge_live_root_cause(workload_id: int) -> bool:
    """Name the root cause of a hung workload across nodes that report separately (idempotent)."""
    return live.live_root_cause_merge(workload_id) is not None
