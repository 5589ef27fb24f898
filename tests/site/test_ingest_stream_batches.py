"""Chunk bodies larger than one write batch: hashed and written by writer threads, batch after batch."""

from __future__ import annotations

import hashlib
import os

from apps.workloads import uploads
from apps.workloads.api.stream import WRITE_BATCH_BYTES
from apps.workloads.models import Upload
from tests.site.test_ingest_stream import app, call, chunk_headers, route


def open_upload(personas, size: int) -> Upload:
    sha = hashlib.sha256(os.urandom(16)).hexdigest()
    return uploads.upload_create(token=personas.agent_token, sha256=sha, size=size, filename="ci-big.tar.zst").upload


def pieces_of(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def test_a_body_of_several_batches_in_odd_pieces_is_appended_whole(personas):
    data = os.urandom(3 * WRITE_BATCH_BYTES + 12345)
    upload = open_upload(personas, len(data) * 2)
    headers = chunk_headers(personas.agent_secret, 0, data)
    status, answer_headers, _ = call(app(), "PATCH", route(str(upload.id)), headers, pieces_of(data, 97 * 1024 + 7))
    assert status == 204
    assert answer_headers[b"upload-offset"] == str(len(data)).encode()
    assert uploads.part_path(upload).read_bytes() == data


def test_a_wrong_checksum_over_several_batches_appends_nothing(personas):
    data = os.urandom(2 * WRITE_BATCH_BYTES + 1)
    upload = open_upload(personas, len(data))
    headers = chunk_headers(personas.agent_secret, 0, data, checksum="0" * 64)
    status, _, answer = call(app(), "PATCH", route(str(upload.id)), headers, pieces_of(data, 256 * 1024))
    assert (status, answer) == (422, {"detail": "chunk checksum mismatch"})
    assert uploads.part_path(upload).stat().st_size == 0
    assert Upload.objects.get(pk=upload.pk).offset == 0


def test_a_disk_that_fills_in_a_later_batch_answers_507_and_keeps_nothing(personas, monkeypatch):
    data = os.urandom(3 * WRITE_BATCH_BYTES)
    upload = open_upload(personas, len(data))
    real_pwrite = os.pwrite

    def pwrite_until_full(fd, block, offset):
        if offset >= 2 * WRITE_BATCH_BYTES:
            raise OSError(28, "No space left on device")
        return real_pwrite(fd, block, offset)

    monkeypatch.setattr(os, "pwrite", pwrite_until_full)
    headers = chunk_headers(personas.agent_secret, 0, data)
    status, _, answer = call(app(), "PATCH", route(str(upload.id)), headers, pieces_of(data, 256 * 1024))
    monkeypatch.undo()
    assert status == 507
    assert answer["reason"] == "disk full"
    assert uploads.part_path(upload).stat().st_size == 0


def test_a_client_that_leaves_after_a_batch_was_written_appends_nothing(personas):
    data = os.urandom(2 * WRITE_BATCH_BYTES)
    upload = open_upload(personas, len(data))
    headers = chunk_headers(personas.agent_secret, 0, data)
    sent = pieces_of(data[: WRITE_BATCH_BYTES + 4096], 4096)
    status, _, _ = call(app(), "PATCH", route(str(upload.id)), headers, sent, disconnect=True)
    assert status is None
    assert uploads.part_path(upload).stat().st_size == 0
    assert Upload.objects.get(pk=upload.pk).offset == 0
