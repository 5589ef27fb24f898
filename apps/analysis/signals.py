"""Housekeeping tied to workloads: a deleted workload's cached trace exports go with it (after commit)."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models.signals import post_delete
from django.dispatch import receiver

from apps.workloads.models import Workload
from comminsight_site.objectstore import object_store

from .services import exports_prefix


@receiver(post_delete, sender=Workload, dispatch_uid="analysis-remove-trace-exports")
def remove_trace_exports(sender: type[Workload], instance: Workload, **kwargs: Any) -> None:
    prefix = exports_prefix(instance.pk)
    transaction.on_commit(lambda: object_store().delete_prefix(prefix))
