"""Discovery: archives agents wrote to the shared path (``<archive path>/comminsight/02_archives``).

Every new ``*.tar.zst`` found there is hashed and registered (owned by the System Settings' discovery
owner, else root) and ingested like an upload; the file itself stays where it is — the site never
moves or deletes anything in the shared path, and changing the path only changes where it looks.
A file already registered under the same path, size and modification time is not hashed again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from django.conf import settings
from django.core.cache import cache
from django.db.models import Q
from django.utils import timezone

from apps.accounts.models import Role, User

from .models import Archive, ArchiveSource, SystemSettings
from .uploads import archive_register, file_sha256

logger = logging.getLogger(__name__)

ARCHIVE_SUBDIR = Path("comminsight") / "02_archives"
MAX_FILES_PER_SCAN = 10_000


def discovery_root(settings_row: SystemSettings | None = None) -> Path | None:
    """``<archive path>/comminsight/02_archives``: System Settings' path, else the site's default (the agent's)."""
    row = settings_row or SystemSettings.load()
    path = row.archive_path or settings.DEFAULT_ARCHIVE_PATH
    return Path(path) / ARCHIVE_SUBDIR if path else None


def discovery_owner(settings_row: SystemSettings) -> User | None:
    return settings_row.discovery_owner or User.objects.filter(role=Role.ROOT).first()


@dataclass
class DiscoveryScan:
    """What one scan saw: ``problem`` says why nothing was scanned (no path, no owner, no directory)."""

    root: Path | None
    owner: str = ""
    problem: str = ""
    queued: list[Path] = field(default_factory=list)  # newly registered; ingest queued
    known: list[Path] = field(default_factory=list)  # registered before (same path, size, mtime or bytes)
    skipped: list[tuple[Path, str]] = field(default_factory=list)  # (path, why)

    @property
    def found(self) -> int:
        return len(self.queued) + len(self.known) + len(self.skipped)


def discovery_scan(archive_path: Path | str | None = None) -> DiscoveryScan:
    """Scan once: register every new archive under the discovery root and queue its ingest.

    ``archive_path`` replaces System Settings' archive path for this scan only (the setting is unchanged);
    the scan looks under ``<archive path>/comminsight/02_archives`` either way.
    """
    row = SystemSettings.load()
    root = Path(archive_path) / ARCHIVE_SUBDIR if archive_path else discovery_root(row)
    scan = DiscoveryScan(root=root)
    owner = discovery_owner(row)
    if root is None:
        scan.problem = "no archive path: set one in System Settings or pass one"
        return scan
    if owner is None:
        scan.problem = "no owner for discovered archives: no discovery owner is set and no root account exists"
        return scan
    scan.owner = owner.username
    if not root.is_dir():
        scan.problem = f"{root} is not a directory"
        return scan
    for index, path in enumerate(sorted(root.rglob("*.tar.zst"))):
        if index >= MAX_FILES_PER_SCAN:
            logger.warning("discovery stopped after %d files under %s", MAX_FILES_PER_SCAN, root)
            scan.skipped.append((path, f"over {MAX_FILES_PER_SCAN} files in one scan; the next scan continues"))
            break
        # Regular files only: a symlink could point anywhere on the server.
        if path.is_symlink() or not path.is_file():
            scan.skipped.append((path, "not a regular file"))
            continue
        stat = path.stat()
        mtime = datetime.fromtimestamp(stat.st_mtime, tz=UTC)
        if Archive.objects.filter(Q(path=str(path)) & Q(size=stat.st_size) & Q(file_mtime=mtime)).exists():
            scan.known.append(path)
            continue
        try:
            sha256 = file_sha256(path)
        except OSError as exc:
            logger.warning("discovery cannot read %s: %s", path, exc)
            scan.skipped.append((path, f"unreadable: {exc.strerror or exc}"))
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
        (scan.queued if created else scan.known).append(path)
    return scan


LAST_SCAN_KEY = "discovery:last-scan"


def discover_archives() -> int:
    """Register every new archive under the discovery root; return how many were new (the periodic task).

    What the scan saw is kept (in the cache, shared by every worker) for System Settings' background jobs.
    """
    started = timezone.now()
    scan = discovery_scan()
    summary = {
        "at": started.isoformat(),
        "root": str(scan.root or ""),
        "queued": len(scan.queued),
        "known": len(scan.known),
        "skipped": len(scan.skipped),
        "problem": scan.problem,
    }
    cache.set(LAST_SCAN_KEY, summary, timeout=None)
    return len(scan.queued)


def discovery_last_scan() -> dict | None:
    """The periodic scan's last summary (``at`` as a datetime), or None before the first one."""
    summary = cache.get(LAST_SCAN_KEY)
    if not summary:
        return None
    return {**summary, "at": datetime.fromisoformat(summary["at"])}
