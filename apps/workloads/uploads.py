"""State changes of the upload protocol (docs/formats/upload.md): create, append a chunk, finalize, one-shot.

Bytes are streamed to ``<data dir>/uploads/<upload id>.part`` in 1 MiB blocks, never held whole in
memory. A chunk is written at the upload's offset while its sha256 is computed; if anything is wrong
(checksum, size, a short body) the file is truncated back to the old offset, so nothing is appended.
The part file is locked (``flock``) while a chunk is written, so two clients appending to one upload take
turns, also across server processes; the offset moves with one conditional UPDATE. Chunks are not fsync'ed
one by one: finalize fsyncs the verified file before the archive is registered. Archives are identified by
owner and sha256: ``archive_register`` records each once per owner (a unique constraint settles races) and
queues ingest after the transaction commits. The bytes are stored once whoever sends them (the store key is
the sha256), and every owner who uploaded them gets an archive of their own, ingested into their workload.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from apps.accounts.models import AgentToken, User
from comminsight_site import rows
from comminsight_site.objectstore import object_store

from .models import Archive, ArchiveSource, Upload, UploadState

logger = logging.getLogger(__name__)


BLOCK = 1 << 20
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
SAFE_FILENAME = re.compile(r"^[A-Za-z0-9._-]{1,255}$")


class UploadError(Exception):
    """A refused upload request. ``status`` is the HTTP status the protocol gives it."""

    status = 400

    def __init__(self, detail: str, **extra: object) -> None:
        super().__init__(detail)
        self.detail = detail
        self.extra = extra


class UploadNotFound(UploadError):
    status = 404


class UploadConflict(UploadError):
    status = 409


class UploadTooLarge(UploadError):
    status = 413


class UploadChecksumMismatch(UploadError):
    status = 422


class UploadStorageFull(UploadError):
    """The server's disk (or quota on it) is full: nothing was kept, the client retries later."""

    status = 507


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


@contextmanager
def disk_full_as_507() -> Iterator[None]:
    """Turn "no space left" (and a file size limit) into ``UploadStorageFull``; other OS errors pass."""
    try:
        yield
    except OSError as exc:
        if exc.errno in DISK_FULL_ERRNOS:
            raise UploadStorageFull(
                "the server has no space left to store this upload; nothing was kept, retry later",
                reason="disk full",
            ) from exc
        raise


def uploads_dir() -> Path:
    path = Path(settings.DATA_DIR) / "uploads"
    path.mkdir(parents=True, exist_ok=True)
    return path


def part_path(upload: Upload) -> Path:
    return uploads_dir() / f"{upload.id}.part"


def archive_key(sha256: str) -> str:
    """The object-store key of stored archive bytes (no .tar.zst suffix: see comminsight_site.objectstore)."""
    return f"archives/{sha256[:2]}/{sha256}"


@dataclass(frozen=True)
class UploadOutcome:
    """Either an open upload to continue, or the archive that is already stored (nothing left to send)."""

    upload: Upload | None = None
    archive: Archive | None = None
    created: bool = False


def _check_sha256(value: object) -> str:
    if not isinstance(value, str) or not SHA256_HEX.match(value):
        raise UploadError("sha256 must be 64 lowercase hex digits")
    return value


def _check_filename(value: object) -> str:
    name = os.path.basename(str(value or ""))
    if not SAFE_FILENAME.match(name):
        raise UploadError("filename must be 1-255 characters of A-Z a-z 0-9 . _ -")
    return name


def owner_bytes_in_use(owner: User, exclude_upload: Upload | None = None) -> int:
    """Stored archives plus the declared size of open uploads: what the owner's quota counts. One bare
    statement (every new upload asks)."""
    archive_size, upload_size = rows.column(Archive, "size"), rows.column(Upload, "size")
    upload_owner, upload_id = rows.column(Upload, "owner"), rows.column(Upload, "id")
    sql = (
        f"SELECT (SELECT COALESCE(SUM({archive_size}), 0) FROM {rows.table(Archive)} "  # noqa: S608
        f"WHERE {rows.column(Archive, 'owner')} = %s) + (SELECT COALESCE(SUM({upload_size}), 0) "
        f"FROM {rows.table(Upload)} WHERE {upload_owner} = %s AND {rows.column(Upload, 'state')} = %s"
        + (f" AND {upload_id} <> %s)" if exclude_upload is not None else ")")
    )
    params = [owner.pk, owner.pk, UploadState.OPEN.value]
    if exclude_upload is not None:
        params.append(rows.param(Upload, "id", exclude_upload.pk))
    with rows.cursor() as cursor:
        cursor.execute(sql, params)
        return int(cursor.fetchone()[0])


def _check_caps(token: AgentToken, size: int) -> None:
    if size > settings.INGEST_MAX_ARCHIVE_BYTES:
        raise UploadTooLarge(f"archive of {size} bytes is over the {settings.INGEST_MAX_ARCHIVE_BYTES}-byte limit")
    if token.uploaded_bytes + size > settings.INGEST_TOKEN_MAX_BYTES:
        raise UploadTooLarge("this agent token has reached its upload cap; create another token or raise the cap")
    if owner_bytes_in_use(token.owner) + size > settings.INGEST_OWNER_QUOTA_BYTES:
        raise UploadTooLarge(f"{token.owner.username}'s storage quota would be exceeded; delete old workloads")


def upload_create(
    *, token: AgentToken, sha256: str, size: int, filename: str, workload_id: str = "", node: str = ""
) -> UploadOutcome:
    """Start (or resume) an upload; answer with the stored archive if that sha256 is already known."""
    sha256 = _check_sha256(sha256)
    filename = _check_filename(filename)
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise UploadError("size must be a positive integer")
    # Known bytes are answered only from the caller's own archives: another owner's copy is no proof that this
    # caller holds them (and must not be revealed); it uploads them, and the bytes are still stored once.
    owner_column, sha_column = rows.column(Archive, "owner"), rows.column(Archive, "sha256")
    existing = rows.select_one(Archive, f"t.{owner_column} = %s AND t.{sha_column} = %s", [token.owner_id, sha256])
    if existing is not None:
        return UploadOutcome(archive=existing)
    resumable = rows.select_one(
        Upload,
        f"t.{rows.column(Upload, 'token')} = %s AND t.{rows.column(Upload, 'sha256')} = %s "
        f"AND t.{rows.column(Upload, 'state')} = %s",
        [token.pk, sha256, UploadState.OPEN.value],
    )
    if resumable is not None:
        return UploadOutcome(upload=resumable)
    _check_caps(token, size)
    upload = Upload(
        id=uuid.uuid4(),
        token=token,
        owner=token.owner,
        sha256=sha256,
        size=size,
        filename=filename,
        workload_external_id=str(workload_id)[:200],
        node=str(node)[:200],
    )
    try:
        with transaction.atomic():
            upload.save(force_insert=True)
    except IntegrityError:
        # The same agent raced itself: continue the upload that won.
        return UploadOutcome(upload=Upload.objects.get(token=token, sha256=sha256, state=UploadState.OPEN))
    try:
        with disk_full_as_507():
            part_path(upload).touch()
    except UploadStorageFull:
        upload.delete()  # no part file, no upload: the agent asks again later
        raise
    return UploadOutcome(upload=upload, created=True)


def _parse_checksum(header: str | None) -> str:
    algorithm, _, value = (header or "").strip().partition(" ")
    if algorithm.lower() != "sha256" or not SHA256_HEX.match(value.strip().lower()):
        raise UploadError("Upload-Checksum must be 'sha256 <64 hex digits of this chunk>'")
    return value.strip().lower()


class ChunkWriter:
    """One chunk being appended: the part file opened and locked, its checks passed, bytes hashed as written.

    Made by ``chunk_begin``; the caller feeds the body with ``write`` (any block size, nothing buffered
    here), then calls ``commit`` (checksum, length, one conditional UPDATE) or ``abort``. Both release the
    lock and close the file; after either, the part file holds exactly the bytes acknowledged so far.
    The Django view and the streaming ASGI path (``comminsight_site.ingest_stream``) share it, so the
    same checks run, in the same order, before a byte is written.
    """

    def __init__(self, part: IO[bytes], upload: Upload, offset: int, length: int, expected: str) -> None:
        self.part, self.upload, self.offset, self.length, self.expected = part, upload, offset, length, expected
        self.digest = hashlib.sha256()
        self.written = 0
        self.fd = part.fileno()

    def write(self, block: bytes | memoryview) -> None:
        """Hash and write ``block`` at the current position; raises once the chunk would exceed its length."""
        if self.written + len(block) > self.length:
            raise UploadError(f"body is longer than its Content-Length {self.length}; nothing was appended")
        self.digest.update(block)
        with disk_full_as_507():
            view = memoryview(block)
            while view:
                count = os.pwrite(self.fd, view, self.offset + self.written)
                self.written += count
                view = view[count:]

    def write_all(self, blocks: list[bytes]) -> None:
        """``write`` each of ``blocks`` in turn."""
        for block in blocks:
            self.write(block)

    def commit(self) -> Upload:
        """Move the upload's offset past this chunk; on any refusal the chunk is taken back (abort)."""
        try:
            if self.written != self.length:
                raise UploadError(f"body ended after {self.written} of {self.length} bytes; nothing was appended")
            if self.digest.hexdigest() != self.expected:
                raise UploadChecksumMismatch("chunk checksum mismatch")
            if (
                _offset_move(self.upload, self.offset, self.offset + self.written) != 1
            ):  # the upload was expired or deleted meanwhile
                raise UploadNotFound("no such upload")
        except BaseException:
            self.abort()
            raise
        self.part.close()  # closing releases the flock
        self.upload.offset = self.offset + self.written
        return self.upload

    def abort(self) -> None:
        """Take back whatever this chunk wrote and release the file. Safe to call twice."""
        if self.part.closed:
            return
        try:
            os.ftruncate(self.fd, self.offset)
        except OSError:
            logger.exception("could not truncate upload %s back to %d", self.upload.pk, self.offset)
        finally:
            self.part.close()


def _offset_move(upload: Upload, old: int, new: int) -> int:
    """``Upload.objects.filter(pk=…, offset=old, state=open).update(offset=new, updated_at=now)`` as one bare
    statement (every chunk makes it); the number of rows moved."""
    offset, state = rows.column(Upload, "offset"), rows.column(Upload, "state")
    sql = (
        f"UPDATE {rows.table(Upload)} SET {offset} = %s, {rows.column(Upload, 'updated_at')} = %s "  # noqa: S608
        f"WHERE {rows.column(Upload, 'id')} = %s AND {offset} = %s AND {state} = %s"
    )
    params = [new, rows.param(Upload, "updated_at", timezone.now()), rows.param(Upload, "id", upload.pk), old]
    with rows.cursor() as cursor:
        cursor.execute(sql, [*params, UploadState.OPEN.value])
        return cursor.rowcount


def chunk_begin(*, owner: User, upload_id: uuid.UUID, offset: int, checksum: str | None, length: int) -> ChunkWriter:
    """Open, lock and check an upload for one chunk of ``length`` bytes at ``offset``; raises UploadError.

    Appenders of one upload take turns on an exclusive ``flock`` of its part file (across threads and
    server processes), so the database sees two statements per chunk: this owner/offset check and one
    ``UPDATE … WHERE offset = <old>`` in autocommit at ``commit``. Bytes are not fsync'ed here;
    ``upload_finalize`` makes the verified file durable (see docs/formats/upload.md, "Durability").
    """
    expected = _parse_checksum(checksum)
    try:
        part = open(uploads_dir() / f"{upload_id}.part", "r+b")  # noqa: SIM115 (closed by commit/abort)
    except FileNotFoundError:
        raise UploadNotFound("no such upload") from None
    try:
        fcntl.flock(part.fileno(), fcntl.LOCK_EX)
        upload = upload_get(owner=owner, upload_id=upload_id)
        if upload is None:
            raise UploadNotFound("no such upload")
        if upload.state != UploadState.OPEN:
            raise UploadConflict("upload is already complete", offset=upload.offset)
        on_disk = os.fstat(part.fileno()).st_size
        if on_disk < upload.offset:
            # Acknowledged bytes were lost (a crash before they reached the disk): continue from what is there.
            Upload.objects.filter(pk=upload.pk, offset=upload.offset).update(offset=on_disk, updated_at=timezone.now())
            raise UploadConflict(f"the server kept {on_disk} bytes; continue from there", offset=on_disk)
        if offset != upload.offset:
            raise UploadConflict(f"offset {offset} does not match the server's {upload.offset}", offset=upload.offset)
        if length <= 0:
            raise UploadError("an empty chunk appends nothing; send Content-Length > 0")
        if length > settings.INGEST_MAX_CHUNK_BYTES:
            raise UploadTooLarge(f"chunk of {length} bytes is over the {settings.INGEST_MAX_CHUNK_BYTES}-byte limit")
        if offset + length > upload.size:
            raise UploadTooLarge(f"chunk ends at {offset + length}, past the declared size {upload.size}")
        os.ftruncate(part.fileno(), offset)  # a crashed earlier attempt may have left bytes past the offset
    except BaseException:
        part.close()
        raise
    return ChunkWriter(part, upload, offset, length, expected)


def upload_append(
    *, owner: User, upload_id: uuid.UUID, offset: int, checksum: str | None, length: int, body: IO[bytes]
) -> Upload:
    """Append one chunk of ``length`` bytes read from ``body`` at ``offset``. All or nothing.

    One pass: each block is hashed and written as it is read; nothing larger than a block is held.
    """
    writer = chunk_begin(owner=owner, upload_id=upload_id, offset=offset, checksum=checksum, length=length)
    try:
        while writer.written < length:
            block = body.read(min(BLOCK, length - writer.written))
            if not block:
                break
            writer.write(block)
    except BaseException:
        writer.abort()
        raise
    return writer.commit()


def upload_get(*, owner: User, upload_id: uuid.UUID) -> Upload | None:
    """``owner``'s upload ``upload_id``, or None (another owner's is None too). One bare statement: agents ask
    with every chunk and every resume."""
    return rows.select_one(
        Upload,
        f"t.{rows.column(Upload, 'id')} = %s AND t.{rows.column(Upload, 'owner')} = %s",
        [rows.param(Upload, "id", upload_id), owner.pk],
    )


def file_sha256(path: Path, *, sync: bool = False) -> str:
    """sha256 of a file; with ``sync`` its bytes are also flushed to disk (fsync) once hashed."""
    digest = hashlib.sha256()
    buffer = bytearray(BLOCK)
    view = memoryview(buffer)
    with open(path, "rb") as handle:
        while count := handle.readinto(buffer):
            digest.update(view[:count])
        if sync:
            os.fsync(handle.fileno())
    return digest.hexdigest()


def upload_finalize(*, owner: User, upload_id: uuid.UUID) -> tuple[Archive, bool]:
    """Verify the whole file's sha256 and register the archive; (archive, newly stored)."""
    with transaction.atomic():
        upload = Upload.objects.select_for_update().filter(pk=upload_id, owner=owner).first()
        if upload is None:
            raise UploadNotFound("no such upload")
        if upload.state == UploadState.COMPLETE:
            archive = Archive.objects.filter(owner=upload.owner, sha256=upload.sha256).first()
            if archive is not None:
                return archive, False
        if upload.offset != upload.size:
            raise UploadConflict(f"upload has {upload.offset} of {upload.size} bytes", offset=upload.offset)
        path = part_path(upload)
        if not path.exists() and _stored_archive(upload.sha256, upload.size):
            # An earlier finalize verified these bytes and moved them into the store, then its transaction
            # was rolled back (a busy database): register them from there instead of failing every retry.
            mismatch = False
        else:
            # Appends do not fsync; the one durable point of an upload is here, before the archive is registered.
            with disk_full_as_507():
                mismatch = file_sha256(path, sync=True) != upload.sha256
        if mismatch:
            # The bytes are not what was announced: discard (committed below), the client starts over.
            path.unlink(missing_ok=True)
            upload.delete()
    if mismatch:
        raise UploadChecksumMismatch("sha256 mismatch")
    with transaction.atomic():
        upload = Upload.objects.select_for_update().get(pk=upload_id)
        if upload.state == UploadState.COMPLETE:  # a concurrent finalize of this upload got here first
            return Archive.objects.get(owner=upload.owner, sha256=upload.sha256), False
        with disk_full_as_507():  # the upload stays open: finalize again once there is space
            archive, created = archive_register(
                source_path=path,
                sha256=upload.sha256,
                size=upload.size,
                owner=upload.owner,
                filename=upload.filename,
                source=ArchiveSource.UPLOAD,
            )
        upload.state = UploadState.COMPLETE
        upload.save(update_fields=["state", "updated_at"])
        if created:
            AgentToken.objects.filter(pk=upload.token_id).update(uploaded_bytes=F("uploaded_bytes") + upload.size)
    return archive, created


def upload_oneshot(
    *, token: AgentToken, sha256: str, filename: str, body: IO[bytes], length: int
) -> tuple[Archive, bool]:
    """Store a small archive sent in one request (multipart ``file``), verifying its sha256."""
    sha256 = _check_sha256(sha256)
    filename = _check_filename(filename)
    if length > settings.INGEST_MAX_ONESHOT_BYTES:
        raise UploadTooLarge(
            f"one-shot uploads are limited to {settings.INGEST_MAX_ONESHOT_BYTES} bytes; use the resumable protocol"
        )
    existing = Archive.objects.filter(owner=token.owner, sha256=sha256).first()
    if existing is not None:
        return existing, False
    _check_caps(token, length)
    tmp = uploads_dir() / f"oneshot-{uuid.uuid4()}.part"
    digest = hashlib.sha256()
    size = 0
    try:
        with disk_full_as_507(), open(tmp, "wb") as out:
            for block in iter(lambda: body.read(BLOCK), b""):
                size += len(block)
                if size > settings.INGEST_MAX_ONESHOT_BYTES:
                    raise UploadTooLarge("file is larger than the one-shot limit")
                digest.update(block)
                out.write(block)
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != sha256:
            raise UploadChecksumMismatch("sha256 mismatch")
        with disk_full_as_507(), transaction.atomic():
            archive, created = archive_register(
                source_path=tmp, sha256=sha256, size=size, owner=token.owner, filename=filename
            )
            if created:
                AgentToken.objects.filter(pk=token.pk).update(uploaded_bytes=F("uploaded_bytes") + size)
        return archive, created
    finally:
        tmp.unlink(missing_ok=True)


def _stored_archive(sha256: str, size: int) -> str | None:
    """The store location of verified bytes already stored under this sha256 with this size, else None."""
    store = object_store()
    location = store.location(archive_key(sha256))
    if store.exists(location) and store.size(location) == size:
        return location
    return None


def archive_register(
    *,
    source_path: Path,
    sha256: str,
    size: int,
    owner: User,
    filename: str,
    source: str = ArchiveSource.UPLOAD,
    keep_in_place: bool = False,
    file_mtime: object = None,
) -> tuple[Archive, bool]:
    """Record an archive once per owner and sha256 and queue its ingest; (archive, newly recorded).

    Uploaded bytes move into the object store (``archives/``); discovered archives stay where they were found
    (``keep_in_place``). A concurrent registration of the same bytes loses on the unique constraint and
    answers with the winner — both clients get success, one copy is kept.
    """
    existing = Archive.objects.filter(owner=owner, sha256=sha256).first()
    if existing is not None:
        if not keep_in_place:
            Path(source_path).unlink(missing_ok=True)
        return existing, False
    # Identical bytes under an identical name: a racing registration may have stored them already.
    # Locally a rename made durable; in object storage a streamed (multipart) upload.
    if keep_in_place:
        path = str(Path(source_path))
    elif not Path(source_path).exists() and (stored := _stored_archive(sha256, size)):
        path = stored  # moved in by a registration whose transaction did not commit
    else:
        path = object_store().put_file(Path(source_path), archive_key(sha256))
    try:
        with transaction.atomic():
            archive = Archive.objects.create(
                sha256=sha256,
                size=size,
                filename=filename,
                owner=owner,
                source=source,
                path=path,
                file_mtime=file_mtime,
            )
    except IntegrityError:
        return Archive.objects.get(owner=owner, sha256=sha256), False
    from .tasks import ingest_archive

    transaction.on_commit(lambda: ingest_archive.delay(archive.pk))
    logger.info("archive %s (%d bytes, %s) stored for %s", sha256[:12], size, source, owner.username)
    return archive, True


def uploads_expire(older_than_s: float = 7 * 86400) -> int:
    """Delete open uploads nobody touched for ``older_than_s`` (their bytes too); they stop counting
    against the owner's quota. A client that comes back later simply starts over."""
    from datetime import timedelta

    cutoff = timezone.now() - timedelta(seconds=older_than_s)
    expired = 0
    for upload in Upload.objects.filter(state=UploadState.OPEN, updated_at__lt=cutoff)[:10_000]:
        part_path(upload).unlink(missing_ok=True)
        upload.delete()
        expired += 1
    return expired
