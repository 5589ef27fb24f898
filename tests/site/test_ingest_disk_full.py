"""A full disk on a real (small) tmpfs: uploads answer 507 with a reason, keep nothing, hold no file open,
and everything goes through once space returns; an ingest that ran out of space is retried and succeeds."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import subprocess
from pathlib import Path

import pytest
from django.test import Client
from django.urls import reverse

from apps.workloads import ingest, uploads
from apps.workloads.models import Archive, ArchiveState, Upload
from tests.site.archives import sha256_of, valid_archive


@pytest.fixture
def small_disk(tmp_path, settings) -> Path:
    """The data directory on a 2 MiB tmpfs of its own (needs the right to mount: root, or skip)."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    settings.DATA_DIR = mount
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path) -> Path:
    """Write a filler file until the disk refuses another byte; return it (delete it to free the space)."""
    filler = disk / "filler"
    with filler.open("wb", buffering=0) as out, contextlib.suppress(OSError):
        while True:
            out.write(b"\0" * 4096)
    assert os.statvfs(disk).f_bavail == 0
    return filler


def open_files_under(directory: Path) -> list[str]:
    """Files this process holds open under ``directory`` (deleted ones included)."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory)):
            held.append(target)
    return held


def agent(secret: str) -> Client:
    return Client(HTTP_AUTHORIZATION=f"Bearer {secret}")


def patch(client: Client, upload_id: str, offset: int, data: bytes):
    return client.patch(
        reverse("api-ingest-upload", args=[upload_id]),
        data=data,
        content_type="application/offset+octet-stream",
        HTTP_UPLOAD_OFFSET=str(offset),
        HTTP_UPLOAD_CHECKSUM=f"sha256 {hashlib.sha256(data).hexdigest()}",
    )


def test_a_chunk_on_a_full_disk_answers_507_keeps_nothing_and_goes_through_once_space_returns(
    personas, small_disk, tmp_path
):
    archive = valid_archive(tmp_path)
    data = archive.read_bytes()
    client = agent(personas.agent_secret)
    body = {"sha256": sha256_of(archive), "size": len(data), "filename": archive.name}
    upload_id = client.post(reverse("api-ingest-uploads"), body, content_type="application/json").json()["upload_id"]
    filler = fill(small_disk)

    refused = patch(client, upload_id, 0, data)

    assert refused.status_code == 507
    assert refused["Content-Type"] == "application/json"
    assert refused.json()["reason"] == "disk full"
    assert Upload.objects.get(pk=upload_id).offset == 0
    assert uploads.part_path(Upload.objects.get(pk=upload_id)).stat().st_size == 0
    assert open_files_under(small_disk) == []
    filler.unlink()
    assert patch(client, upload_id, 0, data).status_code == 204
    assert client.post(reverse("api-ingest-upload-finalize", args=[upload_id])).status_code == 201


def test_a_one_shot_upload_on_a_full_disk_answers_507_and_leaves_no_staging(personas, small_disk, tmp_path):
    archive = valid_archive(tmp_path)
    fill(small_disk)
    with archive.open("rb") as handle:
        refused = agent(personas.agent_secret).post(
            reverse("api-ingest-archives"), {"file": handle, "sha256": sha256_of(archive)}
        )
    assert refused.status_code == 507
    assert refused.json()["reason"] == "disk full"
    assert not Archive.objects.exists()
    assert list(uploads.uploads_dir().iterdir()) == []
    assert open_files_under(small_disk) == []


def test_an_ingest_that_runs_out_of_space_leaves_no_staging_and_succeeds_once_space_returns(
    personas, small_disk, tmp_path
):
    archive_path = valid_archive(tmp_path)
    archive, created = uploads.archive_register(
        source_path=archive_path,
        sha256=sha256_of(archive_path),
        size=archive_path.stat().st_size,
        owner=personas.alice,
        filename=archive_path.name,
        keep_in_place=True,  # the bytes stay outside the small disk; staging and Parquet go onto it
    )
    assert created
    filler = fill(small_disk)

    with pytest.raises(OSError, match="No space left") as raised:
        ingest.archive_ingest(archive.pk)

    assert raised.value.errno == errno.ENOSPC
    archive.refresh_from_db()
    assert archive.state == ArchiveState.STORED  # kept for the task's retry, not quarantined
    assert archive.attempts == 0  # a full disk does not use up the archive's attempts
    assert list((ingest.store_dir() / ".staging").glob("*")) == []
    assert open_files_under(small_disk) == []
    filler.unlink()
    assert ingest.archive_ingest(archive.pk) == ArchiveState.INGESTED
