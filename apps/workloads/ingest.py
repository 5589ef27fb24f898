"""Archive ingest: verify a stored archive, normalise its segments into the columnar store, update metadata.

``archive_ingest(archive_id)`` is what the Celery task runs. It is idempotent per sha256: an archive
already ingested or quarantined is left alone, and Parquet files are named by the archive's sha256,
so a retry after a worker died overwrites its own partial output instead of duplicating it.

Reading uses ``comminsight.formats.archive.read_archive`` (members streamed from the tar+zstd file,
never extracted; allow-listed names, regular files only, caps on members, bytes and compression
ratio; each member checked against the manifest's size and sha256). Output is first written under
``<data dir>/store/.staging/<sha256>-<archive id>/`` and moved into place only after every member verified, so a
bad archive leaves nothing behind: it is quarantined with the reason, which its owner sees.

Segments become rows through the one record decoder (``comminsight.formats.operations``): the store
keeps its first step's rows (P2P peers still communicator ranks, in ``peer_in_comm``), and
``apps.analysis.services.load_operations`` finishes them over the whole workload, so the site's table
equals the CLI's on the home the archives came from.

Store layout (Parquet, one file per archive and rank)::

    <data dir>/store/workload-<workload pk>/node-<node>/rank-<global rank>/<archive sha256>.parquet

Directory names deliberately avoid ``key=value``: Hive-style names would make pyarrow/polars/DuckDB
add partition columns that collide with the table's own ``workload``/``node``/``rank`` columns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from django.conf import settings
from django.db import InterfaceError, OperationalError, connection, transaction
from django.db.models import Q
from django.utils import timezone

from comminsight.formats.archive import ArchiveError, ArchiveLimits, read_archive
from comminsight.formats.boundedjson import JSONLimitError, loads_bounded
from comminsight.formats.operations import SegmentRecords, segment_rows
from comminsight.formats.rawlog import RawLogError as SegmentError
from comminsight.formats.rawlog import segment_records
from comminsight.formats.samples import SamplesError, read_samples
from comminsight_site.objectstore import object_store

from .bulk import communicators_merge, ranks_upsert
from .live import publish_workload_changed
from .models import Archive, ArchiveSource, ArchiveState, Node, Workload
from .names import communicator_names_apply, stage_process_group_table
from .uploads import DISK_FULL_ERRNOS, archive_key

logger = logging.getLogger(__name__)

COMM_HASH = re.compile(r"^0x[0-9a-f]{16}$")
UNSAFE_PATH_PART = re.compile(r"[^A-Za-z0-9._-]+")
MAX_MANIFEST_RANKS = 1 << 20
MAX_MANIFEST_COMMUNICATORS = 100_000


class IngestError(ValueError):
    """An archive whose content is unacceptable beyond the container checks (e.g. manifest semantics)."""


def store_dir() -> Path:
    """This host's scratch for staging (always local); published objects go through ``object_store()``."""
    return Path(settings.DATA_DIR) / "store"


def store_prefix(workload_id: int) -> str:
    """The object-store key prefix of one workload's Parquet operations store."""
    return f"store/workload-{workload_id}"


def path_part(value: str) -> str:
    """A manifest value made safe as one path component (no separators, never '.' or '..')."""
    safe = UNSAFE_PATH_PART.sub("_", value)[:100].strip(".") or "_"
    return safe


def archive_limits() -> ArchiveLimits:
    return ArchiveLimits(
        max_members=settings.INGEST_ARCHIVE_MAX_MEMBERS,
        max_member_bytes=settings.INGEST_ARCHIVE_MAX_MEMBER_BYTES,
        max_total_bytes=settings.INGEST_ARCHIVE_MAX_TOTAL_BYTES,
        max_ratio=settings.INGEST_ARCHIVE_MAX_RATIO,
    )


def _int(value: Any, what: str, low: int = -1, high: int = 1 << 63) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < high:
        raise IngestError(f"manifest {what} must be an integer in [{low}, {high})")
    return value


def _rank_list(values: list[Any], what: str) -> list[int]:
    """Distinct global ranks, sorted; one pass in C-level builtins (a manifest may list 200,000 of them)."""
    if not all(type(value) is int for value in values) or (values and not 0 <= min(values) <= max(values) < 1 << 31):
        raise IngestError(f"manifest {what} must be integers in [0, {1 << 31})")
    return sorted(set(values))


def _text(value: Any, what: str, required: bool = True, limit: int = 200) -> str:
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value.strip()) or len(value) > limit:
        raise IngestError(f"manifest {what} must be a{' non-empty' if required else ''} string of <= {limit} chars")
    return value.strip()


@dataclass
class ManifestFacts:
    """What the site keeps from a manifest, after checking every field it uses."""

    workload_id: str
    node: str
    host: str
    node_ip: str
    first_ns: int | None
    last_ns: int | None
    ranks: list[int]
    communicators: list[dict[str, Any]]
    record_count: int


def _positions(positions: dict[Any, Any]) -> dict[str, int]:
    """A manifest's ``{"<global rank>": rank in the communicator}``, checked."""
    checked = {}
    for rank, position in positions.items():
        if not isinstance(rank, str) or not rank.isdigit() or int(rank) >= 1 << 31:
            raise IngestError("manifest communicator positions must map global ranks to ranks in the communicator")
        checked[str(int(rank))] = _int(position, "communicator position", 0, 1 << 31)
    return checked


def manifest_facts(manifest: dict[str, Any]) -> ManifestFacts:
    ranks = manifest.get("ranks", [])
    if not isinstance(ranks, list) or len(ranks) > MAX_MANIFEST_RANKS:
        raise IngestError("manifest ranks must be a list of global ranks")
    ranks = _rank_list(ranks, "ranks")
    comms = manifest.get("communicators", [])
    if not isinstance(comms, list) or len(comms) > MAX_MANIFEST_COMMUNICATORS:
        raise IngestError("manifest communicators must be a list")
    communicators = []
    for comm in comms:
        if not isinstance(comm, dict):
            raise IngestError("manifest communicator entries must be objects")
        comm_hash = comm.get("comm_hash")
        if not isinstance(comm_hash, str) or not COMM_HASH.match(comm_hash):
            raise IngestError(f"manifest comm_hash {comm_hash!r} is not 0x followed by 16 hex digits")
        members = comm.get("ranks", [])
        if not isinstance(members, list) or len(members) > MAX_MANIFEST_RANKS:
            raise IngestError("manifest communicator ranks must be a list")
        positions = comm.get("positions", {})
        if not isinstance(positions, dict) or len(positions) > MAX_MANIFEST_RANKS:
            raise IngestError("manifest communicator positions must be an object of global rank -> rank in it")
        communicators.append(
            {
                "comm_hash": comm_hash,
                "comm_name": _text(comm.get("comm_name"), "comm_name", required=False),
                "nranks": _int(comm.get("nranks", 0), "nranks", 0, 1 << 31),
                "ranks": _rank_list(members, "communicator ranks"),
                "positions": _positions(positions),
                "first_ns": _int(comm.get("first_ns", 0), "communicator first_ns", 0) or None,
            }
        )
    time_range = manifest.get("time_range") or {}
    if not isinstance(time_range, dict):
        raise IngestError("manifest time_range must be an object")
    first = time_range.get("first_ns")
    last = time_range.get("last_ns")
    first = None if first is None else _int(first, "time_range.first_ns", 0)
    last = None if last is None else _int(last, "time_range.last_ns", 0)
    if first is not None and last is not None and first > last:
        raise IngestError("manifest time_range.first_ns is after last_ns")
    return ManifestFacts(
        workload_id=_text(manifest.get("workload_id"), "workload_id"),
        node=_text(manifest.get("node"), "node"),
        host=_text(manifest.get("host"), "host", required=False),
        node_ip=_text(manifest.get("node_ip"), "node_ip", required=False, limit=64),
        first_ns=first,
        last_ns=last,
        ranks=ranks,
        communicators=communicators,
        record_count=_int(manifest.get("record_count", 0), "record_count", 0),
    )


@dataclass
class StagedArchive:
    facts: ManifestFacts
    staging: Path
    files: dict[int, Path] = field(default_factory=dict)  # global rank -> staged parquet
    hang_files: list[Path] = field(default_factory=list)
    table_files: list[Path] = field(default_factory=list)  # the import hook's process-group tables
    samples_files: list[Path] = field(default_factory=list)  # device and NIC counter samples (metrics/)
    rows: int = 0
    corrupt_records: int = 0


def staging_dir(archive: Archive) -> Path:
    """Where one archive's attempt stages its output (per archive row: two owners' rows share their bytes)."""
    return store_dir() / ".staging" / f"{archive.sha256}-{archive.pk}"


def stage_archive(archive: Archive) -> StagedArchive:
    """Read and verify the whole archive, writing Parquet into a staging directory. Raises on any problem."""
    staging = staging_dir(archive)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with object_store().local_file(archive.path, scratch=staging) as local:
        return _stage_members(archive, staging, *read_archive(local, archive_limits()))


def _stage_members(archive: Archive, staging: Path, manifest: dict[str, Any], members: Any) -> StagedArchive:
    facts = manifest_facts(manifest)
    staged = StagedArchive(facts=facts, staging=staging)
    writers: dict[int, pq.ParquetWriter] = {}
    sinks: dict[int, pa.NativeFile] = {}
    segment_members: dict[str, set[int]] = {}  # communicator -> global ranks whose segments hold its records
    segment_ranks: set[int] = set()  # global ranks named by a segment header
    try:
        for name, data in members:
            if name.startswith("hang/"):
                try:
                    loads_bounded(
                        data,
                        what=name,
                        max_bytes=settings.INGEST_ARCHIVE_MAX_MEMBER_BYTES,
                        max_depth=settings.API_JSON_MAX_DEPTH,
                    )
                except JSONLimitError as exc:
                    raise IngestError(str(exc)) from None
                target = staging / "hang" / name.removeprefix("hang/")
                target.parent.mkdir(exist_ok=True)
                target.write_bytes(data)
                staged.hang_files.append(target)
                continue
            if name.startswith("metadata/"):
                table_file = stage_process_group_table(staging, name, data)
                if table_file is not None:
                    staged.table_files.append(table_file)
                continue
            if name.startswith("metrics/"):
                _stage_samples(archive, staged, name, data)
                continue
            if not name.startswith("segments/"):
                continue
            try:
                hdr, records, corrupt = segment_records(data, Path(name))
            except SegmentError as exc:
                raise IngestError(str(exc)) from exc
            if hdr.global_rank >= 0:
                segment_ranks.add(hdr.global_rank)
            staged.corrupt_records += corrupt
            if len(records) == 0:
                continue
            # Step-1 rows of the one record decoder: load_operations finishes them over the whole store.
            table = segment_rows([SegmentRecords(hdr, records)])
            rank = hdr.global_rank if hdr.global_rank >= 0 else -1
            if rank >= 0:
                for comm in np.unique(records["comm_hash"]).tolist():
                    segment_members.setdefault(f"0x{int(comm):016x}", set()).add(rank)
            if rank not in writers:
                staged.files[rank] = staging / f"rank-{rank}.parquet"
                # The writer gets a file we own: its close() can fail (a full disk) before closing its file.
                sinks[rank] = pa.OSFile(str(staged.files[rank]), "wb")
                writers[rank] = pq.ParquetWriter(sinks[rank], table.schema, compression="zstd")
            writers[rank].write_table(table)
            staged.rows += table.num_rows
    except BaseException:
        _close_writers(writers, sinks, quiet=True)
        raise
    _close_writers(writers, sinks, quiet=False)
    staged.facts = _with_segment_ranks(facts, segment_ranks, segment_members)
    return staged


def _stage_samples(archive: Archive, staged: StagedArchive, name: str, data: bytes) -> None:
    """Keep an archive's device and NIC samples for the monitoring app; an unusable table is skipped with a
    warning (the counters are side information: the archive's operations still count)."""
    try:
        samples = read_samples(data)
    except SamplesError as exc:
        logger.warning("archive %s: %s skipped: %s", archive.sha256[:12], name, exc)
        return
    if samples.num_rows:
        target = staged.staging / "samples" / f"{len(staged.samples_files)}.pq"
        target.parent.mkdir(exist_ok=True)
        pq.write_table(samples, target, compression="zstd")
        staged.samples_files.append(target)


def _close_writers(writers: dict[int, pq.ParquetWriter], sinks: dict[int, pa.NativeFile], *, quiet: bool) -> None:
    """Close every Parquet writer and its file, whatever fails; unless ``quiet``, raise the first failure."""
    first: BaseException | None = None
    for rank, sink in sinks.items():  # a writer may be missing: its constructor failed after the file opened
        try:
            if rank in writers:
                writers[rank].close()
        except Exception as exc:  # kept, raised below once every file is closed
            first = first or exc
        finally:
            sink.close()
    if first is not None and not quiet:
        raise first


def _with_segment_ranks(
    facts: ManifestFacts, segment_ranks: set[int], segment_members: dict[str, set[int]]
) -> ManifestFacts:
    """The ranks and communicators the archive's segments hold, described by the manifest where it can.

    The segments are the truth, and they bound what ingest writes: a rank is kept when a segment header names
    it, a communicator when a segment holds one of its records, a communicator's members and positions when
    they are such ranks. A manifest may list fewer (an agent that saw every rank of a lab job as its own host
    lists none while the segments carry both ranks' records) or far more (a 95 KB manifest naming 200,000
    ranks): rows stay proportional to the data either way. The manifest adds names, sizes, positions and times.
    """
    held = segment_ranks.union(*segment_members.values())
    listed = {comm["comm_hash"]: comm for comm in facts.communicators}
    communicators = []
    for comm_hash, members in sorted(segment_members.items()):
        comm = listed.get(comm_hash, {})
        positions = {rank: at for rank, at in comm.get("positions", {}).items() if int(rank) in members}
        communicators.append(
            {
                "comm_hash": comm_hash,
                "comm_name": comm.get("comm_name", ""),
                "nranks": max(comm.get("nranks", 0), len(members)),
                "ranks": sorted(members),
                "positions": positions,
                "first_ns": comm.get("first_ns"),
            }
        )
    return dataclasses.replace(facts, ranks=sorted(held), communicators=communicators)


def _publish(staged: StagedArchive, workload: Workload, archive: Archive) -> list[str]:
    """Move staged files into the object store; return their locations."""
    store = object_store()
    node_prefix = f"{store_prefix(workload.pk)}/node-{path_part(staged.facts.node)}"
    published = []
    for rank, source in staged.files.items():
        published.append(store.put_file(source, f"{node_prefix}/rank-{rank}/{archive.sha256}.parquet"))
    for source in staged.table_files:
        # one table per process; a later archive carries a newer version of the same table
        published.append(store.put_file(source, f"{metadata_prefix(workload.pk)}/{path_part(source.name)}"))
    for i, source in enumerate(staged.samples_files):
        key = f"{samples_prefix(workload.pk, staged.facts.node)}/{archive.sha256}/{i}{SAMPLES_SUFFIX}"
        published.append(store.put_file(source, key))
    for source in staged.hang_files:
        published.append(store.put_file(source, f"{node_prefix}/hang/{archive.sha256[:16]}/{path_part(source.name)}"))
    return published


def workload_facts_apply(workload: Workload, facts: ManifestFacts) -> Node:
    """Merge what one node reported (its ranks, communicators, time range) into ``workload``; return the node.

    Shared by archive ingest and ``import_evidence`` so both keep the metadata the same way. Ranks and
    communicators are written in bulk (``apps.workloads.bulk``): call it inside a short transaction.
    """
    now = timezone.now()
    node, _ = Node.objects.get_or_create(workload=workload, name=facts.node)
    node.host = facts.host or node.host
    node.node_ip = facts.node_ip or node.node_ip
    node.save(update_fields=["host", "node_ip", "last_seen_at"])
    ranks_upsert(workload, node, facts.ranks)
    communicators_merge(workload, facts.communicators)
    if facts.first_ns is not None:
        workload.first_ns = min(workload.first_ns or facts.first_ns, facts.first_ns)
    if facts.last_ns is not None:
        workload.last_ns = max(workload.last_ns or facts.last_ns, facts.last_ns)
    workload.first_seen_at = workload.first_seen_at or now
    workload.last_seen_at = max(workload.last_seen_at or now, now)
    # Only these fields: heartbeats update the live fields of the same row concurrently.
    workload.save(update_fields=["first_ns", "last_ns", "first_seen_at", "last_seen_at", "updated_at"])
    return node


def _workload_for(archive: Archive, facts: ManifestFacts) -> Workload:
    """The owner's workload the archive belongs to, created (and committed) when it is the first archive."""
    workload, _ = Workload.objects.get_or_create(
        owner=archive.owner,
        external_id=facts.workload_id,
        defaults={"name": facts.workload_id, "first_seen_at": timezone.now()},
    )
    return workload


def _quarantine(archive: Archive, reason: str) -> None:
    # Uploaded bytes move aside for inspection; discovered files stay where they are (the path is not ours).
    # The bytes may be shared by other owners' archives of the same sha256: every row follows them.
    store = object_store()
    if archive.source == ArchiveSource.UPLOAD and store.exists(archive.path):
        stored_at = archive.path
        archive.path = store.move(stored_at, f"quarantine/{archive.sha256}")
        Archive.objects.filter(path=stored_at).exclude(pk=archive.pk).update(path=archive.path)
    archive.state = ArchiveState.QUARANTINED
    archive.reason = reason[:2000]
    archive.lease_owner, archive.lease_until = "", None
    archive.save(update_fields=["path", "state", "reason", "lease_owner", "lease_until"])
    logger.warning("archive %s quarantined: %s", archive.sha256[:12], reason)


INGEST_CANCELLED = "Ingest cancelled by "


def archive_queued_cancel(archive_id: int, by: str) -> bool:
    """Quarantine an archive waiting for ingest with the reason "Ingest cancelled by <by>." (its owner sees it;
    the bytes are kept, uploaded ones under ``quarantine/`` like any refused archive). Only an archive no attempt
    holds (no ``lease_owner``: never claimed, or waiting for a retry) is cancelled: a running attempt publishes
    its output before it commits, so it is left to finish. Once quarantined, every later attempt skips it
    (``_claim`` answers its state). False when it was not waiting (being ingested, ingested, quarantined)."""
    with transaction.atomic():
        archive = Archive.objects.select_for_update().filter(pk=archive_id).first()
        if archive is None or archive.state != ArchiveState.STORED or archive.lease_owner:
            return False
        _quarantine(archive, f"{INGEST_CANCELLED}{by}.")
    return True


INGEST_REQUEUED = "Re-queued by "


class RequeueRefused(Exception):
    """An archive cannot go back in the ingest queue; the message says why (shown to the administrator)."""


def archive_quarantined_requeue(archive_id: int, by: str) -> bool:
    """Put a quarantined archive (refused, given up on, or cancelled) back in the ingest queue: state stored,
    attempts counted from 0 again (so it gets ``INGEST_MAX_ATTEMPTS`` more, no more), ``requeued_by`` and
    ``requeued_at`` kept, and the reason "Re-queued by <by> (quarantined before: <old reason>)" until an attempt
    ends; its ingest is queued once this commits. Uploaded bytes move back from ``quarantine/`` to where stored
    archives live (every row sharing them follows).

    True when this call re-queued it; False when it was already waiting for or held by an ingest (nothing
    changes: asking twice is harmless). Raises :class:`RequeueRefused` for an ingested archive and for one whose
    stored bytes are gone or no longer the size recorded (a discovered file removed or rewritten since)."""
    from .tasks import ingest_archive  # tasks import this module

    with transaction.atomic():
        archive = Archive.objects.select_for_update().filter(pk=archive_id).first()
        if archive is None:
            raise RequeueRefused("no such archive")
        if archive.state == ArchiveState.STORED:
            return False
        if archive.state != ArchiveState.QUARANTINED:
            raise RequeueRefused(f"{archive.filename} is already ingested")
        store = object_store()
        if not store.exists(archive.path) or store.size(archive.path) != archive.size:
            raise RequeueRefused(
                f"the stored bytes of {archive.filename} are gone or changed (expected {archive.size} bytes "
                f"at {archive.path})"
            )
        stored_at = store.location(archive_key(archive.sha256))
        if archive.source == ArchiveSource.UPLOAD and archive.path != stored_at:
            quarantined_at = archive.path
            archive.path = store.move(quarantined_at, archive_key(archive.sha256))
            Archive.objects.filter(path=quarantined_at).exclude(pk=archive.pk).update(path=archive.path)
        archive.state = ArchiveState.STORED
        archive.attempts = 0
        archive.reason = f"{INGEST_REQUEUED}{by} (quarantined before: {archive.reason})"[:2000]
        archive.lease_owner, archive.lease_until = "", None
        archive.requeued_by, archive.requeued_at = by, timezone.now()
        archive.save(
            update_fields=[
                "path",
                "state",
                "attempts",
                "reason",
                "lease_owner",
                "lease_until",
                "requeued_by",
                "requeued_at",
            ]
        )
        transaction.on_commit(lambda: ingest_archive.delay(archive.pk))
    logger.info("archive %s re-queued for ingest by %s", archive.sha256[:12], by)
    return True


class _Claim:
    """One ingest attempt's hold on an archive (``lease_owner``), renewed by a thread while the attempt runs."""

    def __init__(self, archive: Archive, owner: str) -> None:
        self.archive = archive
        self.owner = owner
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name=f"ingest-lease-{archive.pk}", daemon=True)

    def _renew(self) -> None:
        lease = timedelta(seconds=settings.INGEST_LEASE_S)
        try:
            while not self._stop.wait(settings.INGEST_LEASE_S / 3):
                Archive.objects.filter(pk=self.archive.pk, lease_owner=self.owner).update(
                    lease_until=timezone.now() + lease
                )
        except Exception:  # a lost renewal only lets the requeue start a duplicate, which then finds it busy
            logger.exception("ingest lease of archive %s not renewed", self.archive.pk)
        finally:
            connection.close()  # this thread's own connection

    def __enter__(self) -> _Claim:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _claim(archive_id: int) -> _Claim | str:
    """Take the archive for one attempt, counting it in a transaction of its own (it survives the attempt's
    failure), or answer why not: its state, 'busy' (another attempt holds it), 'missing'. An archive that used
    up its attempts is quarantined here, whatever ended them (an exception, a killed or stuck worker)."""
    now = timezone.now()
    with transaction.atomic():
        archive = Archive.objects.select_for_update(skip_locked=True).filter(pk=archive_id).first()
        if archive is None:
            return "busy" if Archive.objects.filter(pk=archive_id).exists() else "missing"
        if archive.state != ArchiveState.STORED:
            return archive.state
        if archive.lease_owner and archive.lease_until and archive.lease_until > now:
            return "busy"
        if archive.attempts >= settings.INGEST_MAX_ATTEMPTS:
            last = archive.reason or "the worker ingesting it stopped every time (killed, out of memory or time)"
            _quarantine(archive, f"ingest gave up after {archive.attempts} attempts; the last: {last}")
            return ArchiveState.QUARANTINED
        archive.attempts += 1
        archive.lease_owner = uuid.uuid4().hex
        archive.lease_until = now + timedelta(seconds=settings.INGEST_LEASE_S)
        archive.save(update_fields=["attempts", "lease_owner", "lease_until"])
    return _Claim(archive, archive.lease_owner)


def _held(claim: _Claim) -> Archive | None:
    """The archive row, locked until the transaction ends, if this attempt still holds it (else None)."""
    archive = Archive.objects.select_for_update().filter(pk=claim.archive.pk).first()
    if archive is None or archive.state != ArchiveState.STORED or archive.lease_owner != claim.owner:
        return None
    return archive


def _attempt_failed(claim: _Claim, exc: BaseException) -> str:
    """Record why an attempt failed (its owner sees it) and let the archive go: quarantined when the
    attempts are used up, else left stored for a retry after a back-off (``lease_until`` with no owner)."""
    reason = f"attempt {claim.archive.attempts} failed: {type(exc).__name__}: {str(exc)[:500]}"
    with transaction.atomic():
        archive = _held(claim)
        if archive is None:
            return Archive.objects.filter(pk=claim.archive.pk).values_list("state", flat=True).first() or "missing"
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
            # Nothing is wrong with the archive: a full disk must not use up its attempts (it would be
            # quarantined while the operator frees space); it is retried like any other failed attempt.
            archive.attempts -= 1
            archive.save(update_fields=["attempts"])
        elif archive.attempts >= settings.INGEST_MAX_ATTEMPTS:
            _quarantine(archive, f"ingest gave up after {archive.attempts} attempts; the last: {reason}")
            return ArchiveState.QUARANTINED
        delay = min(settings.INGEST_RETRY_DELAY_S * 2 ** max(archive.attempts - 1, 0), 3600)
        archive.reason = reason
        archive.lease_owner, archive.lease_until = "", timezone.now() + timedelta(seconds=delay)
        archive.save(update_fields=["reason", "lease_owner", "lease_until"])
    return ArchiveState.STORED


def _ingest_claimed(claim: _Claim) -> tuple[str, Workload | None, StagedArchive | None]:
    """Stage (no transaction), publish (no transaction), then record everything in one short transaction."""
    archive = claim.archive
    staged = None
    try:
        staged = stage_archive(archive)
    finally:
        if staged is None:
            shutil.rmtree(staging_dir(archive), ignore_errors=True)
    try:
        workload = _workload_for(archive, staged.facts)
        # Named by sha256: a retry after a crash overwrites its own objects. No row is locked meanwhile.
        _publish(staged, workload, archive)
        shutil.rmtree(staged.staging, ignore_errors=True)  # published: nothing is left behind once it commits
        with transaction.atomic():
            archive = _held(claim)
            if archive is None:  # our lease ran out and another attempt took over: it finishes the job
                return "busy", None, staged
            workload_facts_apply(workload, staged.facts)
            now = timezone.now()
            archive.workload = workload
            archive.node = staged.facts.node
            archive.record_count = staged.rows
            archive.first_ns = staged.facts.first_ns
            archive.last_ns = staged.facts.last_ns
            archive.state = ArchiveState.INGESTED
            archive.reason = f"{staged.corrupt_records} corrupt records skipped" if staged.corrupt_records else ""
            archive.ingested_at = now
            archive.lease_owner, archive.lease_until = "", None
            archive.save()
            with workload_metadata_dir(workload) as tables:
                communicator_names_apply(workload, tables)
    finally:
        shutil.rmtree(staged.staging, ignore_errors=True)
    return ArchiveState.INGESTED, workload, staged


# Failures worth a prompt retry by the task's own policy (a database or storage hiccup); any other exception
# is recorded and retried by the periodic requeue after a back-off, up to INGEST_MAX_ATTEMPTS.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (OperationalError, InterfaceError, OSError)


def archive_ingest(archive_id: int) -> str:
    """Ingest one stored archive; return its resulting state ('busy' when another attempt holds it).

    Whatever goes wrong, the archive ends quarantined with a reason after at most ``INGEST_MAX_ATTEMPTS``
    attempts: content errors quarantine at once, other exceptions are counted (the count is committed before
    the attempt starts) and retried. Transient errors are raised again for the task's retry policy.
    """
    claim = _claim(archive_id)
    if isinstance(claim, str):
        return claim
    try:
        with claim:
            state, workload, staged = _ingest_claimed(claim)
    except (ArchiveError, IngestError) as exc:
        with transaction.atomic():
            archive = _held(claim)
            if archive is None:
                return "busy"
            _quarantine(archive, str(exc))
        return ArchiveState.QUARANTINED
    except Exception as exc:  # RecursionError, MemoryError, a time limit, a bug: bounded by the attempt count
        state = _attempt_failed(claim, exc)
        if isinstance(exc, TRANSIENT_ERRORS) and state == ArchiveState.STORED:
            raise
        logger.exception("archive %s: ingest attempt failed (%s)", archive_id, state)
        return state
    if state != ArchiveState.INGESTED or workload is None or staged is None:
        return state
    logger.info("archive %s ingested: %d rows for workload %s", claim.archive.sha256[:12], staged.rows, workload.pk)
    publish_workload_changed(workload.pk)  # open pages show the new ranks, communicators and archive
    return ArchiveState.INGESTED


def stale_stored_archives(older_than_s: float = 600) -> list[int]:
    """Archives waiting for ingest that no live attempt holds, for the periodic task to queue again: a lost
    task message (stored long ago, never claimed), a killed or stuck worker (its lease expired), a failed
    attempt whose back-off is over. Ingest is idempotent and claims are exclusive, so a duplicate is harmless.
    Archives that used up their attempts are included: the claim quarantines them."""
    now = timezone.now()
    cutoff = now - timedelta(seconds=older_than_s)
    never_claimed = Q(lease_until__isnull=True, created_at__lt=cutoff)
    stale = Archive.objects.filter(
        never_claimed | Q(lease_until__lt=now),
        state=ArchiveState.STORED,
        attempts__lte=settings.INGEST_MAX_ATTEMPTS,
    )
    return list(stale.order_by("pk").values_list("pk", flat=True)[:1000])


def workload_parquet_files(workload: Workload) -> list[str]:
    """Locations of a workload's Parquet files (read them with ``object_store().dataset``)."""
    return object_store().list(store_prefix(workload.pk), suffix=".parquet")


# Not ".parquet": whoever reads a workload's operations takes every *.parquet under its prefix.
SAMPLES_SUFFIX = ".samples.pq"


def samples_prefix(workload_id: int, node: str) -> str:
    """Where a node's device and NIC counter samples (from archives) are kept in the object store."""
    return f"{store_prefix(workload_id)}/node-{path_part(node)}/samples"


def metadata_prefix(workload_id: int) -> str:
    """Where the workload's process-group tables are kept in the object store (apps.workloads.names)."""
    return f"{store_prefix(workload_id)}/metadata"


def workload_table_files(workload: Workload) -> list[str]:
    """Locations of the workload's process-group tables: part of the store's state for anything that shows names."""
    found = object_store().list(metadata_prefix(workload.pk), suffix=".json")
    return [loc for loc in found if PurePosixPath(loc).name.startswith("process_groups-")]


@contextlib.contextmanager
def workload_metadata_dir(workload: Workload) -> Iterator[Path]:
    """The workload's process-group tables in a local directory: the store's own when local, else a copy."""
    store = object_store()
    if not store.remote:
        yield Path(store.path(metadata_prefix(workload.pk)))
        return
    scratch = Path(settings.DATA_DIR) / "tmp"
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch) as copy:
        for location in workload_table_files(workload):
            (Path(copy) / PurePosixPath(location).name).write_bytes(store.read_bytes(location))
        yield Path(copy)
