"""Sealing: closed raw-log segments (and hang evidence) -> one archive in the spool, exactly once.

A seal runs every archive interval and at shutdown:
1. segments left unsealed by a dead writer (``*.cilog`` whose header pid is gone, untouched for the
   orphan grace) are renamed ``*.cilog.sealed`` — the agent seals them for the writer;
2. every ``*.cilog.sealed`` is read (vectorised) for the manifest: record count, ranks,
   communicators, time range; a segment with an unusable header is moved to quarantine with a log line;
3. a journal (``<state>/seal-journal.json``) names the archive and its inputs, then the archive is
   written to ``<spool>/.staging/`` (temp + rename), the inputs are deleted, the archive and its
   sidecar are renamed into the spool, and the journal is removed.
After a crash the journal says where it stopped: archive complete in staging -> finish the steps;
archive absent -> discard the journal (the inputs are still there and go into the next seal). So an
input is in exactly one delivered archive, whatever moment the agent was killed.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from comminsight.agent.ingest import atomic_write_json
from comminsight.agent.providers import SpoolEntry
from comminsight.agent.segments import SEALED_SUFFIX, SegmentError, read_header, read_segment
from comminsight.agent.spool import Spool
from comminsight.evidence.process_groups import FILE_NAME as TABLE_NAME
from comminsight.evidence.process_groups import MAX_TABLE_BYTES, TableError, parse_table
from comminsight.formats.archive import MEMBER_NAME, ArchiveMember, archive_filename, write_archive
from comminsight.lifeline import pid_alive

log = logging.getLogger("comminsight.agent.archiver")
MAX_HANG_FILE_BYTES = 16 << 20
MAX_SEGMENTS_PER_ARCHIVE = 4000


@dataclass
class SealStats:
    archives: int = 0
    records: int = 0
    segments: int = 0
    quarantined: int = 0
    orphans_sealed: int = 0
    last_seal_ns: int = 0
    last_archive: str = ""


def _known_times(values: np.ndarray, unknown: int | None = None) -> np.ndarray:
    """The nanosecond times of ``values`` that can be times (0 < t < 2**63): filtered out, or set to ``unknown``."""
    known = (values > 0) & (values <= np.uint64(np.iinfo(np.int64).max))
    if unknown is None:
        return values[known].astype(np.int64)
    return np.where(known, values, np.uint64(unknown)).astype(np.int64)


class Archiver:
    def __init__(
        self,
        logs_dir: Path,
        hang_dir: Path,
        state_dir: Path,
        spool: Spool,
        *,
        workload_id: str,
        node: str,
        host: str,
        node_ip: str,
        orphan_grace_s: float = 5.0,
        proc_root: Path = Path("/proc"),
        metadata_dir: Path | None = None,
    ) -> None:
        self.logs_dir = logs_dir
        self.hang_dir = hang_dir
        self.state_dir = state_dir
        self.spool = spool
        self.staging = spool.dir / ".staging"
        self.quarantine = state_dir / "quarantine"
        self.journal = state_dir / "seal-journal.json"
        self.identity = {"workload_id": workload_id, "node": node, "host": host, "node_ip": node_ip}
        self.orphan_grace_s = orphan_grace_s
        self.proc_root = proc_root
        self.stats = SealStats()
        self.dropped_since_seal = {"ring": 0, "lost": 0}
        # process-group tables (the import hook's) live beside the agent's own state
        self.metadata_dir = metadata_dir if metadata_dir is not None else state_dir.parent
        self.archived_tables: dict[str, tuple[int, int]] = {}  # name -> (mtime_ns, size) at the last seal

    # ---- crash recovery ------------------------------------------------------------------------
    def recover(self) -> None:
        """Finish or discard a seal interrupted by a crash (see the module docstring)."""
        self.staging.mkdir(parents=True, exist_ok=True)
        try:
            journal = json.loads(self.journal.read_text())
        except FileNotFoundError:
            journal = None
        except (OSError, ValueError) as exc:
            log.warning("seal journal unreadable (%s); discarding it", exc)
            journal = None
            self.journal.unlink(missing_ok=True)
        if journal:
            name = journal["archive"]
            staged = self.staging / name
            if (self.spool.dir / name).exists():
                log.info("seal of %s had completed before the restart", name)
            elif staged.exists():
                log.info("completing the interrupted seal of %s", name)
                self._commit(journal)
            else:
                log.info("discarding the interrupted seal of %s (archive not written; inputs kept)", name)
        self.journal.unlink(missing_ok=True)
        for leftover in self.staging.iterdir():
            leftover.unlink(missing_ok=True)  # partial writes from a killed seal

    # ---- sealing -------------------------------------------------------------------------------
    def seal_orphans(self, grace_s: float | None = None) -> int:
        """Seal unsealed segments whose writer is dead (crash or SIGKILL left them open)."""
        grace = self.orphan_grace_s if grace_s is None else grace_s
        sealed = 0
        try:
            candidates = sorted(p for p in self.logs_dir.iterdir() if p.name.endswith(".cilog"))
        except OSError:
            return 0
        now = time.time()
        for path in candidates:
            try:
                hdr = read_header(path)
                idle = now - path.stat().st_mtime
            except (SegmentError, OSError):
                continue  # reported by the tailer; a half-written header may still become valid
            if pid_alive(hdr.pid, self.proc_root) or idle < grace:
                continue
            try:
                os.rename(path, path.with_name(path.name + SEALED_SUFFIX))
            except OSError:
                continue
            sealed += 1
            log.info("sealed %s for dead writer pid %d", path.name, hdr.pid)
        self.stats.orphans_sealed += sealed
        return sealed

    def _hang_files(self) -> list[Path]:
        try:
            return sorted(
                p
                for p in self.hang_dir.iterdir()
                if p.is_file() and p.name.endswith(".json") and not p.name.startswith(".")
            )
        except OSError:
            return []

    def _table_members(self, pids: set[int]) -> tuple[list[ArchiveMember], dict[str, tuple[int, int]]]:
        """Process-group tables for this seal: those of the processes in it, and any new or changed one.

        Tables stay in place (their process may rewrite them); a bad one is skipped with a warning.
        """
        members: list[ArchiveMember] = []
        stamps: dict[str, tuple[int, int]] = {}
        try:
            paths = sorted(p for p in self.metadata_dir.iterdir() if TABLE_NAME.match(p.name))
        except OSError:
            return members, stamps
        for path in paths:
            try:
                st = path.stat()
                stamp = (st.st_mtime_ns, st.st_size)
                pid = int(path.name.rsplit("-", 1)[1].split(".", 1)[0])
            except (OSError, ValueError, IndexError):
                continue
            if pid not in pids and self.archived_tables.get(path.name) == stamp:
                continue
            try:
                if st.st_size > MAX_TABLE_BYTES:
                    raise TableError(f"larger than {MAX_TABLE_BYTES >> 20} MiB")
                data = path.read_bytes()
                parse_table(data, path.name)
            except (OSError, TableError) as exc:
                log.warning("process-group table %s not archived: %s", path, exc)
                continue
            members.append(ArchiveMember(f"metadata/{path.name}", data=data))
            stamps[path.name] = stamp
        return members, stamps

    def seal(self, final: bool = False, extra: Sequence[ArchiveMember] = ()) -> SpoolEntry | None:
        """Seal what is closed into one spooled archive; returns its entry, or None when nothing was closed.

        ``extra`` members (live step summaries, counter samples) go into the archive when one is written;
        with None returned they were not archived and the caller keeps them for the next seal.
        """
        self.seal_orphans(0.0 if final else None)
        try:
            sealed = sorted(p for p in self.logs_dir.iterdir() if p.name.endswith(".cilog" + SEALED_SUFFIX))
        except OSError:
            sealed = []
        sealed = sealed[:MAX_SEGMENTS_PER_ARCHIVE]
        members: list[ArchiveMember] = []
        inputs: list[str] = []
        first_ns, last_ns = 0, 0
        ranks: set[int] = set()
        comms: dict[int, dict[str, Any]] = {}
        records_total = 0
        pids: set[int] = set()
        for path in sealed:
            if not MEMBER_NAME.match(f"segments/{path.name}"):
                self._quarantine(path, "its name is not allowed in an archive")
                continue
            try:
                hdr, records, corrupt = read_segment(path)
            except (SegmentError, OSError) as exc:
                self._quarantine(path, str(exc))
                continue
            if corrupt:
                log.warning("%s: %d corrupt records (kept in the archive; readers skip them)", path.name, corrupt)
            members.append(ArchiveMember(f"segments/{path.name}", path=path, records=len(records)))
            inputs.append(str(path))
            records_total += len(records)
            pids.add(hdr.pid)
            if hdr.global_rank >= 0:
                ranks.add(hdr.global_rank)
            if len(records):
                # Times beyond int64 are not times (the decoder reads them as unknown): keep them out of the range.
                times = _known_times(records["enqueue_start_ns"])
                ends = np.maximum(_known_times(records["complete_ns"], 0), _known_times(records["enqueue_end_ns"], 0))
                lo = int(times.min()) if len(times) else 0
                hi = int(ends.max())
                first_ns = lo if not first_ns or (lo and lo < first_ns) else first_ns
                last_ns = max(last_ns, hi)
                uniq, index, inverse = np.unique(records["comm_hash"], return_index=True, return_inverse=True)
                never = np.iinfo(np.int64).max
                starts = records["enqueue_start_ns"].astype(np.int64)
                firsts = np.full(len(uniq), never, dtype=np.int64)
                np.minimum.at(firsts, inverse, np.where(starts > 0, starts, never))
                for comm, i, first in zip(uniq.tolist(), index.tolist(), firsts.tolist(), strict=True):
                    c = comms.setdefault(
                        comm,
                        {
                            "comm_hash": f"0x{comm:016x}",
                            "comm_name": "",
                            "nranks": 0,
                            "ranks": set(),
                            "positions": {},
                            "first_ns": 0,
                        },
                    )
                    if first != never:
                        c["first_ns"] = min(c["first_ns"] or first, first)
                    if hdr.global_rank >= 0 and records["rank"][i] >= 0:
                        c["positions"][str(hdr.global_rank)] = int(records["rank"][i])
                    c["comm_name"] = c["comm_name"] or bytes(records["comm_name"][i]).split(b"\0")[0].decode(
                        "utf-8", "replace"
                    )
                    c["nranks"] = max(c["nranks"], int(records["nranks"][i]), 0)
                    if hdr.global_rank >= 0:
                        c["ranks"].add(hdr.global_rank)
        for path in self._hang_files():
            name = f"hang/{path.name}"
            try:
                if not MEMBER_NAME.match(name) or path.stat().st_size > MAX_HANG_FILE_BYTES:
                    raise ValueError("name not allowed or file too large")
                json.loads(path.read_bytes())
            except (OSError, ValueError) as exc:
                try:
                    fresh = time.time() - path.stat().st_mtime < 10.0
                except OSError:
                    continue
                if not fresh:  # a file still being written gets another chance at the next seal
                    self._quarantine(path, f"hang evidence not archivable: {exc}")
                continue
            members.append(ArchiveMember(name, path=path))
            inputs.append(str(path))
        segment_count = sum(m.name.startswith("segments/") for m in members)  # quarantined ones excluded
        if not segment_count and not (final and (members or extra)):
            return None  # hang files alone wait for the next segment (or the final seal)
        table_members, table_stamps = self._table_members(pids)
        members = table_members + members  # tables first: a reader wanting names stops before the segments
        members.extend(m for m in extra if MEMBER_NAME.match(m.name))
        now = time.time_ns()
        # Records without an enqueue time (or without a completion) still give a range, never an inverted one.
        first_ns = first_ns or last_ns or now
        last_ns = max(last_ns or now, first_ns)
        name = archive_filename(self.identity["workload_id"], self.identity["node"], first_ns, last_ns)
        while (self.spool.dir / name).exists():
            last_ns += 1
            name = archive_filename(self.identity["workload_id"], self.identity["node"], first_ns, last_ns)
        manifest = {
            **self.identity,
            "created_ns": now,
            "time_range": {"first_ns": first_ns, "last_ns": last_ns},
            "ranks": sorted(ranks),
            "communicators": [{**c, "ranks": sorted(c["ranks"])} for _, c in sorted(comms.items())],
            "dropped": dict(self.dropped_since_seal),
        }
        journal = {"archive": name, "inputs": inputs, "records": records_total}
        atomic_write_json(self.journal, journal)
        written = write_archive(self.staging / name, manifest, members)
        entry = SpoolEntry(
            path=self.spool.dir / name,
            sha256=written.sha256,
            size=written.size,
            created_ns=now,
            records=records_total,
            workload_id=self.identity["workload_id"],
            node=self.identity["node"],
            pending=list(self.spool.providers),
        )
        sidecar = {
            "sha256": entry.sha256,
            "size": entry.size,
            "created_ns": now,
            "records": records_total,
            "workload_id": entry.workload_id,
            "node": entry.node,
            "pending": entry.pending,
            "extra": {},
        }
        atomic_write_json(self.staging / (name[: -len(".tar.zst")] + ".json"), sidecar)
        self._commit(journal)
        self.journal.unlink(missing_ok=True)
        self.dropped_since_seal = {"ring": 0, "lost": 0}
        self.archived_tables.update(table_stamps)
        self.stats.archives += 1
        self.stats.records += records_total
        self.stats.segments += segment_count
        self.stats.last_seal_ns = now
        self.stats.last_archive = name
        log.info(
            "sealed %s: %d segments, %d records, sha256 %s",
            name,
            segment_count,
            records_total,
            written.sha256,
        )
        self.spool.wake.set()
        return entry

    def _commit(self, journal: dict[str, Any]) -> None:
        """Delete the inputs, then move the staged sidecar and archive into the spool (archive last)."""
        for item in journal["inputs"]:
            Path(item).unlink(missing_ok=True)
        name = journal["archive"]
        sidecar = name[: -len(".tar.zst")] + ".json"
        if (self.staging / sidecar).exists():
            os.replace(self.staging / sidecar, self.spool.dir / sidecar)
        os.replace(self.staging / name, self.spool.dir / name)

    def _quarantine(self, path: Path, reason: str) -> None:
        self.quarantine.mkdir(parents=True, exist_ok=True)
        log.error("skipping %s: %s (moved to %s)", path.name, reason, self.quarantine)
        try:
            os.replace(path, self.quarantine / path.name)
        except OSError:
            path.unlink(missing_ok=True)
        self.stats.quarantined += 1
