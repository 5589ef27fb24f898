"""Discovery: archives agents wrote to the shared path (``<archive path>/comminsight/02_archives``).

Every new ``*.tar.zst`` found there is hashed and registered (owned by the System Settings' discovery
owner, else root) and ingested like an upload; the file itself stays where it is — the site never
moves or deletes anything in the shared path, and changing the path only changes where it looks.
A file already registered under the same path, size and modification time is not hashed again.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path

from django.db.models import Q

from apps.accounts.models import Role, User

from .models import Archive, ArchiveSource, SystemSettings
from .uploads import archive_register, file_sha256

logger = logging.getLogger(__name__)

ARCHIVE_SUBDIR = Path("comminsight") / "02_archives"
MAX_FILES_PER_SCAN = 10_000


def discovery_root(settings_row: SystemSettings | None = None) -> Path | None:
    row = settings_row or SystemSettings.load()
    return Path(row.archive_path) / ARCHIVE_SUBDIR if row.archive_path else None


def discovery_owner(settings_row: SystemSettings) -> User | None:
    return settings_row.discovery_owner or User.objects.filter(role=Role.ROOT).first()


def discover_archives() -> int:
    """Register every new archive under the discovery root; return how many were new."""
    row = SystemSettings.load()
    root = discovery_root(row)
    owner = discovery_owner(row)
    if root is None or owner is None or not root.is_dir():
        return 0
    registered = 0
    for index, path in enumerate(sorted(root.rglob("*.tar.zst"))):
        if index >= MAX_FILES_PER_SCAN:
            logger.warning("discovery stopped after %d files under %s", MAX_FILES_PER_SCAN, root)
            break
        # Regular files only: a symlink could point anywhere on the server.
        if path.is_symlink() or not path.is_file():
            continue
        stat = path.stat()
        mtime = datetime.fromtimestamp(stat.st_mtime, tz=UTC)
        if Archive.objects.filter(Q(path=str(path)) & Q(size=stat.st_size) & Q(file_mtime=mtime)).exists():
            continue
        try:
            sha256 = file_sha256(path)
        except OSError as exc:
            logger.warning("discovery cannot read %s: %s", path, exc)
            continue
        _, created = archive_register(
            source_path=path,
            sha256=sha256,
            size=stat.st_size,
            owner=owner,
            filename=path.name[:255],
            source=ArchiveSource.DISCOVERY,
            keep_in_place=True,
            file_mtime=mtime,
        )
        registered += int(created)
    return registered
