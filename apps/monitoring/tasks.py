"""Celery tasks of the monitoring app: ids in, idempotent, own time limits and retries."""

from __future__ import annotations

from celery import shared_task
from django.db import InterfaceError, OperationalError

from . import services


@shared_task(
    acks_late=True,
    soft_time_limit=600,
    time_limit=660,
    autoretry_for=(OperationalError, InterfaceError, OSError),
    retry_backoff=True,
    max_retries=5,
)
def record_archive_summaries(archive_id: int) -> int:
    """Step times per rank and throughput per communicator of one ingested archive (idempotent)."""
    return services.archive_summaries_record(archive_id)


@shared_task(soft_time_limit=1800, time_limit=1860)
def purge_expired_points() -> dict[str, int]:
    """Delete time series older than the retention setting."""
    return services.points_purge()


@shared_task(soft_time_limit=50, time_limit=60)
def materialize_bands() -> int:
    """Store min / median / max across series for the buckets that closed since the last run."""
    return services.bands_materialize()
