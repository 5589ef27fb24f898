"""Archive providers: where a sealed archive goes once it is in the spool.

A provider is an object with a ``name`` and ``deliver(entry) -> None`` that either stores the archive
durably (then returns) or raises: ``RetryLater`` (transient; ``after_s`` when the target said how long
to wait) or any other exception (treated as transient too, with exponential backoff). ``deliver``
must be idempotent: it can be called again for an archive it already stored (agent restarted before
recording success).

Built in: ``filesystem`` (shared path, atomic rename) and ``site`` (resumable upload to the site,
comminsight.agent.uploader). Third parties register a factory ``f(config) -> provider`` under the
entry-point group ``comminsight.archive_providers``; ``register`` does the same in-process.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Protocol

from comminsight.agent.config import AgentConfig

log = logging.getLogger("comminsight.agent.providers")
ENTRY_POINT_GROUP = "comminsight.archive_providers"
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


class RetryLater(Exception):
    """Delivery failed for now; ``after_s`` is the target's Retry-After when it gave one."""

    def __init__(self, message: str, after_s: float | None = None) -> None:
        super().__init__(message)
        self.after_s = after_s


@dataclass
class SpoolEntry:
    """One archive in the spool and its delivery state (persisted beside it as ``<name>.json``)."""

    path: Path
    sha256: str
    size: int
    created_ns: int
    records: int = 0
    workload_id: str = ""
    node: str = ""
    pending: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # provider scratch (e.g. the site's upload_id)

    @property
    def name(self) -> str:
        return self.path.name


class ArchiveProvider(Protocol):
    name: str

    def deliver(self, entry: SpoolEntry) -> None: ...


ProviderFactory = Callable[[AgentConfig], ArchiveProvider]
_FACTORIES: dict[str, ProviderFactory] = {}


def register(name: str, factory: ProviderFactory) -> None:
    """Register a provider factory under ``name`` (replaces an earlier one)."""
    _FACTORIES[name] = factory


def available() -> dict[str, ProviderFactory]:
    """Built-in and entry-point providers by name."""
    factories = dict(_FACTORIES)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in factories:
            try:
                factories[ep.name] = ep.load()
            except Exception as exc:  # a broken plug-in must not stop the agent
                log.error("archive provider entry point %s cannot be loaded: %s", ep.name, exc)
    return factories


def build_providers(config: AgentConfig) -> list[ArchiveProvider]:
    """Instantiate the configured providers; unknown names are logged and skipped."""
    factories = available()
    providers = []
    for name in config.effective_providers:
        factory = factories.get(name)
        if factory is None:
            log.error("archive provider %r is not known (known: %s); skipped", name, ", ".join(sorted(factories)))
            continue
        if name == "site" and not config.server_url:
            log.error("archive provider 'site' needs COMMINSIGHT_AGENT_SERVER_URL; skipped")
            continue
        providers.append(factory(config))
    return providers


class FilesystemProvider:
    """Copies archives to ``<root>/<workload>/<node>/`` through a hidden temporary name and a rename."""

    name = "filesystem"

    def __init__(self, root: Path, workload_id: str, node: str) -> None:
        self.root = Path(root)
        self.dest_dir = self.root / (_SAFE.sub("_", workload_id or "unknown")) / _SAFE.sub("_", node or "unknown")

    def deliver(self, entry: SpoolEntry) -> None:
        try:
            self.dest_dir.mkdir(parents=True, exist_ok=True)
            final = self.dest_dir / entry.name
            tmp = self.dest_dir / f".{entry.name}.part-{os.getpid()}"
            with open(entry.path, "rb") as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
                dst.flush()
                os.fsync(dst.fileno())
            # Same name and same bytes for the same archive: re-delivery replaces it with itself.
            os.replace(tmp, final)
            dir_fd = os.open(self.dest_dir, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            raise RetryLater(f"cannot write {self.dest_dir}: {exc.strerror or exc}") from exc


def _filesystem(config: AgentConfig) -> ArchiveProvider:
    return FilesystemProvider(config.archive_root, config.workload_id, config.node)


def _site(config: AgentConfig) -> ArchiveProvider:
    from comminsight.agent.uploader import SiteProvider

    return SiteProvider(config)


register("filesystem", _filesystem)
register("site", _site)
