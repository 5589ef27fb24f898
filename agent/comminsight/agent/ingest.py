"""Ingest: discover and consume every ring under ``<home>/shms/``, fall back to tailing raw-log segments
for writers without a ring, and checkpoint consumer offsets together with the live state.

Exactly-once across agent restarts: the checkpoint (``<home>/metadata/agent/checkpoint.json``,
written atomically) holds the live state and, per ring, the cursor it reflects; only after the
checkpoint is on disk do we publish each ring's ``tail``. A restarted agent restores the state and
resumes each ring at the checkpointed cursor (the records after it are still in the ring, because
the tail was not published past it). Segment tailing keeps byte offsets in the same checkpoint.
Ring and log carry the same records; ``LiveState.fresh`` drops any record of a writer whose
``record_seq`` was already applied, so switching source never double counts.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from comminsight.agent.segments import SEALED_SUFFIX, SegmentError, read_from, read_header
from comminsight.agent.state import LiveState
from comminsight.formats import header
from comminsight.formats.ring import RingError, RingReader
from comminsight.lifeline import pid_alive

log = logging.getLogger("comminsight.agent.ingest")
CHECKPOINT_VERSION = 1
# A ring with a dead writer, fully read and published, is forgotten (and its file removed) after this.
RING_RETIRE_S = 30.0


@dataclass
class IngestCounters:
    records: int = 0
    corrupt_records: int = 0
    malformed_rings: int = 0
    malformed_segments: int = 0
    ring_dropped: dict[str, int] = field(default_factory=dict)
    ring_lost: dict[str, int] = field(default_factory=dict)
    lag_records: int = 0


@dataclass
class _Ring:
    reader: RingReader
    writer: str
    drained_since: float = 0.0


def atomic_write_json(path: Path, payload: Any) -> None:
    """Write JSON to ``path`` via a temporary file, fsync and rename (never a half-written file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as handle:
        json.dump(payload, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


class Ingest:
    """Owns the ring readers and segment offsets; called from the daemon's loop only."""

    def __init__(
        self,
        shms_dir: Path,
        logs_dir: Path,
        state_dir: Path,
        state: LiveState,
        batch_records: int = 65536,
        proc_root: Path = Path("/proc"),
        on_batch: Callable[[str, Any], Any] | None = None,
    ) -> None:
        self.shms_dir = shms_dir
        self.logs_dir = logs_dir
        self.checkpoint_path = state_dir / "checkpoint.json"
        self.state = state
        self.batch_records = batch_records
        self.proc_root = proc_root
        self.on_batch = on_batch  # also sees every verified batch (the live step engine), after the state
        self.rings: dict[str, _Ring] = {}
        self.bad_files: dict[str, tuple[int, float]] = {}  # name -> (size, mtime) of a file already reported
        self.saved_cursors: dict[str, tuple[int, int]] = {}  # ring name -> (writer_start_ns, cursor)
        self.segment_offsets: dict[str, int] = {}
        self.segment_writers: dict[str, str] = {}
        self.counters = IngestCounters()
        self.ring_sources: set[str] = set()  # writers that currently have a ring
        self._last_fingerprint: tuple[Any, ...] = ()

    # ---- checkpoint ----------------------------------------------------------------------------
    def restore(self) -> None:
        try:
            saved = json.loads(self.checkpoint_path.read_text())
            if saved.get("version") != CHECKPOINT_VERSION:
                raise ValueError(f"version {saved.get('version')!r}")
            self.state.restore(saved["state"])
            self.saved_cursors = {k: (int(v[0]), int(v[1])) for k, v in saved.get("rings", {}).items()}
            self.segment_offsets = {k: int(v) for k, v in saved.get("segments", {}).items()}
            log.info(
                "resumed from checkpoint: %d records applied before, %d rings, %d segments",
                self.state.records_applied,
                len(self.saved_cursors),
                len(self.segment_offsets),
            )
        except FileNotFoundError:
            return
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            log.warning(
                "checkpoint %s unreadable (%s); starting from the rings' published tails", self.checkpoint_path, exc
            )

    def checkpoint(self) -> None:
        """Save state + cursors, then publish ring tails (the order is what makes restarts exactly-once)."""
        rings = {name: [r.reader.info.writer_start_ns, r.reader.cursor] for name, r in self.rings.items()}
        # Keep cursors of rings we are not holding open (e.g. malformed now) so nothing is re-read later;
        # forget those whose file is gone.
        self.saved_cursors = {n: v for n, v in self.saved_cursors.items() if (self.shms_dir / n).exists()}
        for name, (start, cursor) in self.saved_cursors.items():
            rings.setdefault(name, [start, cursor])
        live_segments = {
            n: o
            for n, o in self.segment_offsets.items()
            if (self.logs_dir / n).exists() or (self.logs_dir / (n + SEALED_SUFFIX)).exists()
        }
        self.segment_offsets = live_segments
        fingerprint = (
            self.state.records_applied,
            len(self.state.inflight),
            json.dumps(rings),
            json.dumps(live_segments),
        )
        if fingerprint == self._last_fingerprint:
            return  # nothing consumed since the last checkpoint: no write, tails already published
        atomic_write_json(
            self.checkpoint_path,
            {
                "version": CHECKPOINT_VERSION,
                "saved_ns": time.time_ns(),
                "state": self.state.to_json(),
                "rings": rings,
                "segments": live_segments,
            },
        )
        for ring in self.rings.values():
            ring.reader.publish()
        self._last_fingerprint = fingerprint

    # ---- rings ---------------------------------------------------------------------------------
    def _report_bad(self, path: Path, message: str) -> bool:
        """Log a malformed file once per (size, mtime); returns True when it was new."""
        try:
            st = path.stat()
            key = (st.st_size, st.st_mtime)
        except OSError:
            key = (0, 0.0)
        if self.bad_files.get(path.name) == key:
            return False
        self.bad_files[path.name] = key
        log.error("skipping %s", message)
        return True

    def discover_rings(self) -> None:
        try:
            paths = sorted(self.shms_dir.glob("*.ring"))
        except OSError:
            return
        present = {p.name for p in paths}
        for name in [n for n in self.rings if n not in present]:
            self.rings.pop(name).reader.close()
        for path in paths:
            if path.name in self.rings:
                continue
            try:
                st = path.stat()
                if self.bad_files.get(path.name) == (st.st_size, st.st_mtime):
                    continue
            except OSError:
                continue
            saved = self.saved_cursors.get(path.name)
            try:
                reader = RingReader(path)
                if saved and saved[0] == reader.info.writer_start_ns:
                    reader.close()
                    reader = RingReader(path, cursor=saved[1])
            except RingError as exc:
                if self._report_bad(path, f"malformed ring: {exc}"):
                    self.counters.malformed_rings += 1
                continue
            self.bad_files.pop(path.name, None)
            self.rings[path.name] = _Ring(reader, writer=str(reader.info.writer_pid))
            log.info(
                "attached ring %s (writer pid %d, capacity %d, cursor %d)",
                path.name,
                reader.info.writer_pid,
                reader.capacity,
                reader.cursor,
            )
        self.ring_sources = {r.writer for r in self.rings.values()}

    def poll_rings(self, budget: int = 16) -> int:
        """Read every ring until empty (at most ``budget`` batches each); returns records applied."""
        applied = 0
        lag = 0
        for name, ring in list(self.rings.items()):
            reader = ring.reader
            try:
                for _ in range(budget):
                    batch = reader.read(self.batch_records)
                    if batch.corrupt:
                        self.counters.corrupt_records += batch.corrupt
                        log.warning(
                            "%s: %d corrupt records skipped (bad magic or checksum) at index %d",
                            name,
                            batch.corrupt,
                            batch.first_index,
                        )
                    if len(batch.records):
                        applied += self.state.apply(ring.writer, batch.records)
                        if self.on_batch is not None:
                            self.on_batch(ring.writer, batch.records)
                    if batch.next_index == batch.first_index or reader.pending == 0:
                        break
                counters = reader.counters()
            except RingError as exc:
                self._report_bad(reader.path, f"ring with corrupt indices: {exc}")
                self.counters.malformed_rings += 1
                self.saved_cursors[name] = (reader.info.writer_start_ns, reader.cursor)
                reader.close()
                del self.rings[name]
                continue
            self.counters.ring_dropped[name] = counters["dropped"]
            self.counters.ring_lost[name] = counters["lost"]
            lag += reader.pending
            self._maybe_retire(name, ring, counters)
        self.counters.records += applied
        self.counters.lag_records = lag
        return applied

    def _maybe_retire(self, name: str, ring: _Ring, counters: dict[str, int]) -> None:
        """Forget a ring whose writer is gone and which is fully consumed and published."""
        reader = ring.reader
        writer_gone = counters["writer_closed"] or not pid_alive(reader.info.writer_pid, self.proc_root)
        if not writer_gone or reader.pending or reader.tail != reader.cursor:
            ring.drained_since = 0.0
            return
        now = time.monotonic()
        if not ring.drained_since:
            ring.drained_since = now
        elif now - ring.drained_since > RING_RETIRE_S:
            log.info("ring %s: writer %d gone and ring drained; removing it", name, reader.info.writer_pid)
            reader.close()
            del self.rings[name]
            self.saved_cursors.pop(name, None)
            reader.path.unlink(missing_ok=True)

    # ---- raw-log tailing fallback -----------------------------------------------------------------
    def tail_segments(self, max_bytes: int = 64 << 20) -> int:
        """Read new records of segments whose writer has no ring (ring gone, agent late, ring broken)."""
        applied = 0
        hdr_size = header.constants()["CI_LOG_HEADER_SIZE"]
        try:
            paths = sorted(p for p in self.logs_dir.iterdir() if p.name.endswith((".cilog", ".cilog" + SEALED_SUFFIX)))
        except OSError:
            return 0
        for path in paths:
            base = path.name.removesuffix(SEALED_SUFFIX)
            writer = self.segment_writers.get(base)
            if writer is None:
                try:
                    hdr = read_header(path)
                except (SegmentError, OSError) as exc:
                    if self._report_bad(path, f"malformed raw-log segment: {exc}"):
                        self.counters.malformed_segments += 1
                    continue
                writer = str(hdr.pid)
                self.segment_writers[base] = writer
                self.state.set_global_rank(hdr.pid, hdr.global_rank)
            if writer in self.ring_sources:
                continue
            offset = max(self.segment_offsets.get(base, hdr_size), hdr_size)
            try:
                if path.stat().st_size - offset < header.constants()["CI_RECORD_SIZE"]:
                    continue
                records, new_offset, corrupt = read_from(path, offset, max_bytes)
            except OSError:
                continue  # renamed (sealed) between listing and reading: next poll sees the new name
            if corrupt:
                self.counters.corrupt_records += corrupt
                log.warning("%s: %d corrupt records skipped (bad magic or checksum)", path.name, corrupt)
            self.segment_offsets[base] = new_offset
            applied += self.state.apply(writer, records)
            if self.on_batch is not None and len(records):
                self.on_batch(writer, records)
        self.counters.records += applied
        return applied

    def forget_segment(self, name: str) -> None:
        base = name.removesuffix(SEALED_SUFFIX)
        self.segment_offsets.pop(base, None)
        self.segment_writers.pop(base, None)

    def close(self) -> None:
        for ring in self.rings.values():
            ring.reader.close()
        self.rings.clear()
