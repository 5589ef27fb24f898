"""The spool: sealed archives waiting for their providers, and the thread that delivers them.

Layout: ``<home>/spool/<archive>.tar.zst`` with a sidecar ``<archive>.json`` (sha256, size, created,
records, providers still pending, provider scratch). Archives are delivered oldest first; a provider
that fails backs off exponentially with full jitter (or for its Retry-After) without blocking the
others; an archive is deleted once no provider is pending. Caps on total bytes and age drop the
oldest archives — each drop is a log line at ERROR naming the archive and its records, and a metric.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from comminsight.agent.ingest import atomic_write_json
from comminsight.agent.providers import ArchiveProvider, RetryLater, SpoolEntry
from comminsight.formats.archive import file_sha256

log = logging.getLogger("comminsight.agent.spool")
SUFFIX = ".tar.zst"


@dataclass
class SpoolStats:
    dropped_archives: int = 0
    dropped_records: int = 0
    delivered: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    last_error: dict[str, str] = field(default_factory=dict)


class Spool:
    def __init__(
        self,
        directory: Path,
        providers: list[ArchiveProvider],
        max_bytes: int,
        max_age_s: float,
        backoff_initial: float = 1.0,
        backoff_max: float = 300.0,
    ) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.providers = {p.name: p for p in providers}
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.stats = SpoolStats()
        self._next_try: dict[str, float] = {}
        self._attempts: dict[str, int] = {}
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- entries -------------------------------------------------------------------------------
    def _sidecar(self, archive: Path) -> Path:
        return archive.with_name(archive.name[: -len(SUFFIX)] + ".json")

    def load(self, archive: Path) -> SpoolEntry:
        try:
            meta = json.loads(self._sidecar(archive).read_text())
            return SpoolEntry(
                path=archive,
                sha256=meta["sha256"],
                size=int(meta["size"]),
                created_ns=int(meta["created_ns"]),
                records=int(meta.get("records", 0)),
                workload_id=meta.get("workload_id", ""),
                node=meta.get("node", ""),
                pending=[p for p in meta.get("pending", []) if isinstance(p, str)],
                extra=meta.get("extra", {}),
            )
        except (OSError, ValueError, KeyError, TypeError):
            # No (readable) sidecar: an archive placed here by hand or a crash; every provider is pending.
            st = archive.stat()
            return SpoolEntry(
                path=archive,
                sha256=file_sha256(archive),
                size=st.st_size,
                created_ns=int(st.st_mtime * 1e9),
                pending=list(self.providers),
            )

    def save(self, entry: SpoolEntry) -> None:
        atomic_write_json(
            self._sidecar(entry.path),
            {
                "sha256": entry.sha256,
                "size": entry.size,
                "created_ns": entry.created_ns,
                "records": entry.records,
                "workload_id": entry.workload_id,
                "node": entry.node,
                "pending": entry.pending,
                "extra": entry.extra,
            },
        )

    def archives(self) -> list[Path]:
        """Spooled archives, oldest first (names embed the time range; mtime breaks ties)."""
        try:
            found = [p for p in self.dir.iterdir() if p.name.endswith(SUFFIX) and not p.name.startswith(".")]
        except OSError:
            return []

        def age_key(path: Path) -> tuple[int, str]:
            try:
                return path.stat().st_mtime_ns, path.name
            except OSError:  # delivered and removed meanwhile
                return 0, path.name

        return sorted(found, key=age_key)

    def remove(self, archive: Path) -> None:
        archive.unlink(missing_ok=True)
        self._sidecar(archive).unlink(missing_ok=True)

    def usage(self) -> tuple[int, int, float]:
        """(archives, bytes, age of the oldest in seconds)."""
        paths = self.archives()
        size = 0
        oldest = 0.0
        now = time.time()
        for p in paths:
            try:
                st = p.stat()
            except OSError:
                continue
            size += st.st_size
            oldest = max(oldest, now - st.st_mtime)
        return len(paths), size, oldest

    def enforce_caps(self) -> None:
        """Drop the oldest archives while the spool is over its byte or age cap (never silently)."""
        with self.lock:
            stats = {}
            for p in self.archives():
                try:
                    stats[p] = p.stat()
                except OSError:
                    continue
            total = sum(st.st_size for st in stats.values())
            now = time.time()
            for p, st in stats.items():
                too_old = now - st.st_mtime > self.max_age_s
                if total <= self.max_bytes and not too_old:
                    continue
                entry = self.load(p)
                reason = "older than the spool age cap" if too_old else "spool over its byte cap"
                log.error(
                    "spool: dropping archive %s (%d records, %d bytes, providers pending: %s): %s",
                    p.name,
                    entry.records,
                    entry.size,
                    ",".join(entry.pending) or "none",
                    reason,
                )
                self.remove(p)
                total -= st.st_size
                self.stats.dropped_archives += 1
                self.stats.dropped_records += entry.records

    # ---- delivery ------------------------------------------------------------------------------
    def _backoff(self, provider: str, after_s: float | None) -> float:
        attempts = self._attempts.get(provider, 0) + 1
        self._attempts[provider] = attempts
        if after_s is not None:
            delay = after_s
        else:
            # "full jitter": uniform in [0, min(max, initial * 2^attempts)]
            delay = random.uniform(0, min(self.backoff_max, self.backoff_initial * 2 ** min(attempts, 30)))  # noqa: S311
        self._next_try[provider] = time.monotonic() + delay
        return delay

    def deliver_once(self, stop: threading.Event | None = None) -> int:
        """One pass over the spool, oldest first; returns archives fully delivered.

        ``stop`` (the delivery thread's) ends the pass early; the final pass at shutdown has none.
        """
        self.enforce_caps()
        done = 0
        for archive in self.archives():
            if not archive.exists():
                continue
            entry = self.load(archive)
            entry.pending = [p for p in entry.pending if p in self.providers] if entry.pending else []
            for name in list(entry.pending):
                if stop is not None and stop.is_set():
                    return done
                if time.monotonic() < self._next_try.get(name, 0.0):
                    continue  # this provider is backing off; the others may still deliver
                try:
                    self.providers[name].deliver(entry)
                except Exception as exc:  # any single failure must not stop delivery
                    after = exc.after_s if isinstance(exc, RetryLater) else None
                    delay = self._backoff(name, after)
                    self.stats.failures[name] = self.stats.failures.get(name, 0) + 1
                    self.stats.last_error[name] = str(exc)
                    log.warning("delivery of %s to %s failed (%s); retrying in %.1fs", entry.name, name, exc, delay)
                    if entry.extra:
                        self.save(entry)
                    continue
                entry.pending.remove(name)
                self._attempts[name] = 0
                self._next_try.pop(name, None)
                self.stats.delivered[name] = self.stats.delivered.get(name, 0) + 1
                self.stats.last_error.pop(name, None)
                log.info("archive %s delivered to %s (sha256 %s)", entry.name, name, entry.sha256)
                self.save(entry)
            if not entry.pending:
                with self.lock:
                    self.remove(archive)
                done += 1
        return done

    def next_wait(self, default: float) -> float:
        if not self._next_try:
            return default
        return max(0.05, min(default, min(self._next_try.values()) - time.monotonic()))

    def start(self, idle_s: float = 5.0) -> None:
        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.deliver_once(self._stop)
                except Exception:
                    log.exception("spool delivery pass failed")
                self.wake.wait(self.next_wait(idle_s))
                self.wake.clear()

        self._thread = threading.Thread(target=loop, name="comminsight-spool", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.wake.set()
        if self._thread:
            self._thread.join(timeout)
