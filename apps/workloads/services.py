"""State changes for workloads: sharing, unsharing, deletion (the caller has already checked visibility)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from django.db import transaction

from apps.accounts.models import User

from .models import ArchiveSource, ShareLevel, Workload, WorkloadShare
from .selectors import workload_can_manage

logger = logging.getLogger(__name__)


class WorkloadPermissionDenied(Exception):
    """The user sees the workload but may not change it (answers 403, not 404)."""


class WorkloadError(Exception):
    """A refused change; the message is safe to show."""


def _require_manage(actor: User, workload: Workload) -> None:
    if not workload_can_manage(actor, workload):
        raise WorkloadPermissionDenied("You need the manage level on this workload (or to be an administrator).")


def workload_share(*, actor: User, workload: Workload, user: User, level: str = ShareLevel.READ) -> WorkloadShare:
    """Share ``workload`` with ``user`` at ``level`` (re-sharing changes the level)."""
    _require_manage(actor, workload)
    if level not in ShareLevel.values:
        raise WorkloadError(f"Level must be one of {', '.join(ShareLevel.values)}.")
    if user.pk == workload.owner_id:
        raise WorkloadError("The owner already sees this workload.")
    if not user.is_active:
        raise WorkloadError("That user is deactivated.")
    share, _ = WorkloadShare.objects.update_or_create(workload=workload, user=user, defaults={"level": level})
    logger.info("%s shared workload %s with %s (%s)", actor.username, workload.pk, user.username, level)
    return share


def workload_unshare(*, actor: User, workload: Workload, user: User) -> bool:
    """Remove ``user``'s share; True when there was one."""
    _require_manage(actor, workload)
    deleted, _ = WorkloadShare.objects.filter(workload=workload, user=user).delete()
    return bool(deleted)


def workload_delete(*, actor: User, workload: Workload) -> None:
    """Delete a workload with its archives (rows and uploaded bytes) and its columnar store.

    Discovered archive files are left where they were found: the shared path is not the site's.
    Files go only after the rows are gone for good (on commit).
    """
    _require_manage(actor, workload)
    from .ingest import store_dir

    workload_id = workload.pk
    with transaction.atomic():
        uploaded = [
            Path(path) for path in workload.archives.filter(source=ArchiveSource.UPLOAD).values_list("path", flat=True)
        ]
        workload.delete()

        def remove_files() -> None:
            shutil.rmtree(store_dir() / f"workload-{workload_id}", ignore_errors=True)
            for path in uploaded:
                path.unlink(missing_ok=True)

        transaction.on_commit(remove_files)
    logger.info("%s deleted workload %s", actor.username, workload_id)
