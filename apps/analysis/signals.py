"""Housekeeping tied to workloads: a deleted workload's cached trace exports go with it (after commit)."""

from __future__ import annotations

import shutil
from typing import Any

from django.db import transaction
from django.db.models.signals import post_delete
from django.dispatch import receiver

from apps.workloads.models import Workload

from .services import exports_dir


@receiver(post_delete, sender=Workload, dispatch_uid="analysis-remove-trace-exports")
def remove_trace_exports(sender: type[Workload], instance: Workload, **kwargs: Any) -> None:
    folder = exports_dir(instance.pk)
    transaction.on_commit(lambda: shutil.rmtree(folder, ignore_errors=True))
