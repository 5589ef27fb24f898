"""Where the monitoring app is fed: every live heartbeat, and every archive once ingested."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver

from apps.workloads.live import heartbeat_recorded
from apps.workloads.models import Archive, ArchiveState, Workload

from .services import monitoring_record_heartbeat, stored_points_forget


@receiver(heartbeat_recorded, dispatch_uid="monitoring-heartbeat")
def record_heartbeat(
    sender: type[Workload], workload: Workload, node: str, heartbeat: dict[str, Any], at: datetime, **kwargs: Any
) -> None:
    monitoring_record_heartbeat(workload=workload, node=node, heartbeat=heartbeat, at=at)


@receiver(post_save, sender=Workload, dispatch_uid="monitoring-workload-created")
def forget_stored_points_of_new_workload(
    sender: type[Workload], instance: Workload, created: bool, **kwargs: Any
) -> None:
    if created:
        stored_points_forget(instance.pk)


@receiver(post_delete, sender=Workload, dispatch_uid="monitoring-workload-deleted")
def forget_stored_points_of_deleted_workload(sender: type[Workload], instance: Workload, **kwargs: Any) -> None:
    stored_points_forget(instance.pk)


@receiver(post_save, sender=Archive, dispatch_uid="monitoring-archive-summaries")
def summarise_ingested_archive(sender: type[Archive], instance: Archive, **kwargs: Any) -> None:
    if instance.state != ArchiveState.INGESTED or instance.workload_id is None:
        return
    from .tasks import record_archive_summaries

    archive_id = instance.pk
    # After commit: the archive's Parquet files are published in the same transaction.
    transaction.on_commit(lambda: record_archive_summaries.delay(archive_id), robust=True)
