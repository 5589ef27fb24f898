"""The upload protocol as agents see it: create, append, resume, finalize, one-shot, caps and races."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest
from django.db import OperationalError, connection
from django.test import Client
from django.urls import reverse

from apps.accounts.services import agent_token_create
from apps.workloads import uploads
from apps.workloads.models import Archive, ArchiveState, Upload, Workload
from comminsight_site.objectstore import object_store
from tests.site.archives import sha256_of, valid_archive


def agent(secret: str) -> Client:
    return Client(HTTP_AUTHORIZATION=f"Bearer {secret}")


def create(client: Client, path: Path, **extra):
    body = {"sha256": sha256_of(path), "size": path.stat().st_size, "filename": path.name, **extra}
    return client.post(reverse("api-ingest-uploads"), body, content_type="application/json")


def patch(client: Client, upload_id: str, offset: int, data: bytes, checksum: str | None = None):
    return client.patch(
        reverse("api-ingest-upload", args=[upload_id]),
        data=data,
        content_type="application/offset+octet-stream",
        HTTP_UPLOAD_OFFSET=str(offset),
        HTTP_UPLOAD_CHECKSUM=f"sha256 {checksum or hashlib.sha256(data).hexdigest()}",
    )


def finalize(client: Client, upload_id: str):
    return client.post(reverse("api-ingest-upload-finalize", args=[upload_id]))


@pytest.fixture
def archive_file(tmp_path) -> Path:
    return valid_archive(tmp_path)


def test_upload_interrupted_and_resumed_ends_ingested(personas, archive_file, django_capture_on_commit_callbacks):
    client = agent(personas.agent_secret)
    data = archive_file.read_bytes()
    created = create(client, archive_file, workload_id="job-7", node="10.0.0.1")
    assert created.status_code == 201
    upload_id = created.json()["upload_id"]
    half = len(data) // 2
    assert patch(client, upload_id, 0, data[:half]).status_code == 204
    # The connection drops; the agent restarts and asks again: it gets the same upload and its offset.
    resumed = create(client, archive_file)
    assert resumed.status_code == 200
    assert resumed.json() == {**resumed.json(), "upload_id": upload_id, "offset": half, "status": "open"}
    head = client.head(reverse("api-ingest-upload", args=[upload_id]))
    assert head["Upload-Offset"] == str(half)
    assert head["Upload-Length"] == str(len(data))
    assert patch(client, upload_id, half, data[half:]).status_code == 204
    with django_capture_on_commit_callbacks(execute=True):
        done = finalize(client, upload_id)
    assert done.status_code == 201
    assert done.json()["sha256"] == sha256_of(archive_file)
    archive = Archive.objects.get(sha256=sha256_of(archive_file))
    assert archive.state == ArchiveState.INGESTED
    workload = Workload.objects.get(external_id="job-7", owner=personas.alice)
    assert list(workload.nodes.values_list("name", flat=True)) == ["10.0.0.1"]
    assert workload.communicators.get().ranks == [0, 1]


def test_a_finalize_whose_transaction_failed_after_storing_the_bytes_succeeds_when_retried(
    personas, archive_file, monkeypatch
):
    # Seen with the demo on SQLite: the bytes were moved into the store, then "database is locked" rolled the
    # registration back, and every retry of the agent failed on the missing part file.
    client = Client(HTTP_AUTHORIZATION=f"Bearer {personas.agent_secret}", raise_request_exception=False)
    data = archive_file.read_bytes()
    upload_id = create(client, archive_file).json()["upload_id"]
    assert patch(client, upload_id, 0, data).status_code == 204
    real_create = Archive.objects.create
    failures = iter([OperationalError("database is locked")])

    def create_once_failing(**fields):
        if (failure := next(failures, None)) is not None:
            raise failure
        return real_create(**fields)

    monkeypatch.setattr(Archive.objects, "create", create_once_failing)
    assert finalize(client, upload_id).status_code == 500
    assert not Archive.objects.exists()
    retried = finalize(client, upload_id)
    assert retried.status_code == 201
    archive = Archive.objects.get(sha256=sha256_of(archive_file))
    assert object_store().read_bytes(archive.path) == data
    assert finalize(client, upload_id).status_code == 200


def test_wrong_chunk_checksum_appends_nothing(personas, archive_file):
    client = agent(personas.agent_secret)
    upload_id = create(client, archive_file).json()["upload_id"]
    response = patch(client, upload_id, 0, archive_file.read_bytes()[:100], checksum="0" * 64)
    assert response.status_code == 422
    assert response.json()["detail"] == "chunk checksum mismatch"
    upload = Upload.objects.get(pk=upload_id)
    assert upload.offset == 0
    assert uploads.part_path(upload).stat().st_size == 0


def test_wrong_offset_is_refused_with_the_servers_offset(personas, archive_file):
    client = agent(personas.agent_secret)
    upload_id = create(client, archive_file).json()["upload_id"]
    response = patch(client, upload_id, 50, archive_file.read_bytes()[50:100])
    assert response.status_code == 409
    assert response.json()["offset"] == 0


@pytest.mark.parametrize(("declared", "sent"), [(8 * 1024 * 1024 + 2, 8 * 1024 * 1024 + 1), (100, 101)])
def test_chunks_over_the_chunk_limit_or_past_the_size_are_refused(personas, settings, declared, sent):
    settings.INGEST_MAX_CHUNK_BYTES = 8 * 1024 * 1024
    client = agent(personas.agent_secret)
    body = {"sha256": "ef" * 32, "size": declared, "filename": "ci-x.tar.zst"}
    upload_id = client.post(reverse("api-ingest-uploads"), body, content_type="application/json").json()["upload_id"]
    assert patch(client, upload_id, 0, b"x" * sent).status_code == 413
    assert Upload.objects.get(pk=upload_id).offset == 0


def test_wrong_final_sha256_discards_the_upload(personas, archive_file):
    client = agent(personas.agent_secret)
    data = archive_file.read_bytes()
    body = {"sha256": "0" * 64, "size": len(data), "filename": archive_file.name}
    upload_id = client.post(reverse("api-ingest-uploads"), body, content_type="application/json").json()["upload_id"]
    assert patch(client, upload_id, 0, data).status_code == 204
    response = finalize(client, upload_id)
    assert response.status_code == 422
    assert response.json()["detail"] == "sha256 mismatch"
    assert not Upload.objects.filter(pk=upload_id).exists()
    assert not Archive.objects.exists()
    assert list(uploads.uploads_dir().iterdir()) == []


def test_finalize_before_all_bytes_arrived_is_a_conflict(personas, archive_file):
    client = agent(personas.agent_secret)
    upload_id = create(client, archive_file).json()["upload_id"]
    response = finalize(client, upload_id)
    assert response.status_code == 409
    assert response.json()["offset"] == 0


def test_a_known_archive_answers_complete_without_a_second_copy(personas, archive_file):
    client = agent(personas.agent_secret)
    data = archive_file.read_bytes()
    upload_id = create(client, archive_file).json()["upload_id"]
    patch(client, upload_id, 0, data)
    first = finalize(client, upload_id)
    again = create(client, archive_file)
    assert again.status_code == 200
    assert again.json() == {
        "status": "complete",
        "sha256": sha256_of(archive_file),
        "archive_id": first.json()["archive_id"],
    }
    assert Archive.objects.count() == 1


@pytest.mark.parametrize(
    "body",
    [
        {"sha256": "XYZ", "size": 10, "filename": "a.tar.zst"},
        {"sha256": "ab" * 32, "size": 0, "filename": "a.tar.zst"},
        {"sha256": "ab" * 32, "size": -5, "filename": "a.tar.zst"},
        {"sha256": "ab" * 32, "size": 10, "filename": "../../etc/passwd x"},
        {"sha256": "ab" * 32, "size": "ten", "filename": "a.tar.zst"},
        {"size": 10, "filename": "a.tar.zst"},
    ],
)
def test_malformed_create_requests_change_nothing(personas, body):
    response = agent(personas.agent_secret).post(reverse("api-ingest-uploads"), body, content_type="application/json")
    assert response.status_code == 400
    assert not Upload.objects.exists()


def test_archive_over_the_size_cap_token_cap_or_owner_quota_is_refused(personas, settings):
    client = agent(personas.agent_secret)
    url = reverse("api-ingest-uploads")
    body = {"sha256": "ab" * 32, "size": 5000, "filename": "a.tar.zst"}
    settings.INGEST_MAX_ARCHIVE_BYTES = 4000
    assert client.post(url, body, content_type="application/json").status_code == 413
    settings.INGEST_MAX_ARCHIVE_BYTES = 10**9
    settings.INGEST_TOKEN_MAX_BYTES = 4000
    assert "upload cap" in client.post(url, body, content_type="application/json").json()["detail"]
    settings.INGEST_TOKEN_MAX_BYTES = 10**9
    settings.INGEST_OWNER_QUOTA_BYTES = 4000
    assert "quota" in client.post(url, body, content_type="application/json").json()["detail"]
    assert not Upload.objects.exists()


def test_one_shot_upload_stores_once_and_verifies_the_sha256(personas, archive_file):
    client = agent(personas.agent_secret)
    url = reverse("api-ingest-archives")
    with archive_file.open("rb") as handle:
        wrong = client.post(url, {"file": handle, "sha256": "0" * 64})
    assert wrong.status_code == 422
    with archive_file.open("rb") as handle:
        stored = client.post(url, {"file": handle, "sha256": sha256_of(archive_file)})
    assert stored.status_code == 201
    with archive_file.open("rb") as handle:
        again = client.post(url, {"file": handle, "sha256": sha256_of(archive_file)})
    assert again.status_code == 200
    assert Archive.objects.count() == 1
    assert [p.name for p in uploads.uploads_dir().iterdir()] == []


def test_one_shot_over_its_limit_is_refused_before_reading(personas, archive_file, settings):
    settings.INGEST_MAX_ONESHOT_BYTES = 10
    with archive_file.open("rb") as handle:
        response = agent(personas.agent_secret).post(
            reverse("api-ingest-archives"), {"file": handle, "sha256": sha256_of(archive_file)}
        )
    assert response.status_code == 413
    assert not Archive.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_the_same_archive_from_two_agents_at_once_is_stored_once_and_both_succeed(tmp_path, settings):
    from apps.accounts.models import User

    if connection.vendor == "sqlite":
        pytest.skip("concurrent writers need PostgreSQL (in-memory SQLite refuses them with 'table is locked')")
    alice = User.objects.create(username="alice")
    tokens = [agent_token_create(owner=alice, name=f"pool-{i}").token for i in range(2)]
    path = valid_archive(tmp_path)
    data, sha = path.read_bytes(), sha256_of(path)
    barrier = threading.Barrier(2)
    answers: list[tuple[int, bool]] = []

    def send(token) -> None:
        try:
            outcome = uploads.upload_create(token=token, sha256=sha, size=len(data), filename=path.name)
            if outcome.upload is not None:
                uploads.upload_append(
                    owner=alice,
                    upload_id=outcome.upload.id,
                    offset=0,
                    checksum=f"sha256 {sha}",
                    length=len(data),
                    body=__import__("io").BytesIO(data),
                )
                barrier.wait(timeout=10)
                archive, _ = uploads.upload_finalize(owner=alice, upload_id=outcome.upload.id)
            else:
                barrier.wait(timeout=10)
                archive = outcome.archive
            answers.append((archive.pk, archive.sha256 == sha))
        finally:
            connection.close()

    threads = [threading.Thread(target=send, args=(t,)) for t in tokens]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(answers) == 2
    assert answers[0] == answers[1]
    assert answers[0][1] is True
    assert Archive.objects.count() == 1
    assert len(object_store().list("archives")) == 1


class Trickle:
    """A request body that arrives a few bytes at a time, as a slow network delivers it."""

    def __init__(self, data: bytes, step: int = 7) -> None:
        self.data, self.step, self.at = data, step, 0

    def read(self, size: int = -1) -> bytes:
        size = self.step if size < 0 else min(size, self.step)
        block = self.data[self.at : self.at + size]
        self.at += len(block)
        return block


def test_a_chunk_arriving_in_small_pieces_is_appended_whole(personas, archive_file):
    data = archive_file.read_bytes()[:1000]
    upload_id = create(agent(personas.agent_secret), archive_file).json()["upload_id"]
    upload = uploads.upload_append(
        owner=personas.alice,
        upload_id=upload_id,
        offset=0,
        checksum=f"sha256 {hashlib.sha256(data).hexdigest()}",
        length=len(data),
        body=Trickle(data),
    )
    assert upload.offset == len(data)
    assert Upload.objects.get(pk=upload_id).offset == len(data)
    assert uploads.part_path(upload).read_bytes() == data


def test_a_body_shorter_than_its_length_appends_nothing(personas, archive_file):
    data = archive_file.read_bytes()[:1000]
    upload_id = create(agent(personas.agent_secret), archive_file).json()["upload_id"]
    with pytest.raises(uploads.UploadError, match="body ended after 500 of 1000 bytes"):
        uploads.upload_append(
            owner=personas.alice,
            upload_id=upload_id,
            offset=0,
            checksum=f"sha256 {hashlib.sha256(data).hexdigest()}",
            length=len(data),
            body=Trickle(data[:500], step=100),
        )
    upload = Upload.objects.get(pk=upload_id)
    assert upload.offset == 0
    assert uploads.part_path(upload).stat().st_size == 0


def test_another_owners_upload_id_is_unknown_and_untouched(personas, archive_file):
    upload_id = create(agent(personas.agent_secret), archive_file).json()["upload_id"]
    response = patch(agent(personas.carol_agent_secret), upload_id, 0, b"intruder")
    assert response.status_code == 404
    assert uploads.part_path(Upload.objects.get(pk=upload_id)).stat().st_size == 0
    assert patch(agent(personas.agent_secret), "0" * 8 + "-0000-4000-8000-" + "0" * 12, 0, b"x").status_code == 404


def test_bytes_lost_before_reaching_the_disk_are_asked_for_again(personas, archive_file):
    # Chunks are made durable at finalize; after a crash the part file may be shorter than the recorded offset.
    client = agent(personas.agent_secret)
    data = archive_file.read_bytes()
    upload_id = create(client, archive_file).json()["upload_id"]
    assert patch(client, upload_id, 0, data[:300]).status_code == 204
    part = uploads.part_path(Upload.objects.get(pk=upload_id))
    with part.open("r+b") as handle:
        handle.truncate(120)
    response = patch(client, upload_id, 300, data[300:])
    assert response.status_code == 409
    assert response.json()["offset"] == 120
    assert patch(client, upload_id, 120, data[120:]).status_code == 204
    assert finalize(client, upload_id).status_code == 201


@pytest.mark.django_db(transaction=True)
def test_two_appenders_of_one_upload_take_turns_and_the_second_is_told_the_new_offset(tmp_path):
    from apps.accounts.models import User

    if connection.vendor == "sqlite":
        pytest.skip("concurrent writers need PostgreSQL (in-memory SQLite refuses them with 'table is locked')")
    alice = User.objects.create(username="alice")
    token = agent_token_create(owner=alice, name="pool").token
    path = valid_archive(tmp_path)
    data = path.read_bytes()
    upload = uploads.upload_create(token=token, sha256=sha256_of(path), size=len(data), filename=path.name).upload
    barrier = threading.Barrier(2)
    outcomes: list[object] = []

    def send() -> None:
        try:
            barrier.wait(timeout=10)
            uploads.upload_append(
                owner=alice,
                upload_id=upload.id,
                offset=0,
                checksum=f"sha256 {hashlib.sha256(data).hexdigest()}",
                length=len(data),
                body=Trickle(data, step=4096),
            )
            outcomes.append("appended")
        except uploads.UploadConflict as exc:
            outcomes.append(exc.extra["offset"])
        finally:
            connection.close()

    threads = [threading.Thread(target=send) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes, key=str) == sorted(["appended", len(data)], key=str)
    assert Upload.objects.get(pk=upload.id).offset == len(data)
    assert uploads.part_path(upload).read_bytes() == data


def upload_whole(client: Client, path: Path):
    created = create(client, path)
    assert created.status_code == 201  # nothing is answered from another owner's archive
    upload_id = created.json()["upload_id"]
    assert patch(client, upload_id, 0, path.read_bytes()).status_code == 204
    return finalize(client, upload_id)


def test_a_second_owner_uploading_the_same_bytes_gets_an_archive_of_their_own_and_the_data(
    personas, archive_file, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        alices = upload_whole(agent(personas.agent_secret), archive_file)
        with archive_file.open("rb") as handle:  # carol sends the same bytes in one shot
            carols = agent(personas.carol_agent_secret).post(
                reverse("api-ingest-archives"), {"file": handle, "sha256": sha256_of(archive_file)}
            )
    assert (alices.status_code, carols.status_code) == (201, 201)
    assert alices.json()["archive_id"] != carols.json()["archive_id"]
    archives = Archive.objects.filter(sha256=sha256_of(archive_file))
    assert {(a.owner.username, a.state) for a in archives} == {("alice", "ingested"), ("carol", "ingested")}
    assert len({a.path for a in archives}) == 1  # the bytes are stored once
    # Each owner sees their own archive, and each owner's workload got the data.
    for persona, response in ((personas.alice, alices), (personas.carol, carols)):
        client = Client()
        client.force_login(persona)
        assert [a["id"] for a in client.get("/api/v1/archives/").json()] == [response.json()["archive_id"]]
        workload = Workload.objects.get(owner=persona, external_id="job-7")
        assert sorted(workload.ranks.values_list("rank", flat=True)) == [0, 1]
        assert workload.archives.get().pk == response.json()["archive_id"]
    # Sending them again answers each owner with their own archive.
    again = create(agent(personas.carol_agent_secret), archive_file)
    assert (again.status_code, again.json()["archive_id"]) == (200, carols.json()["archive_id"])


def test_deleting_one_owners_workload_keeps_the_bytes_another_owner_still_has(
    personas, archive_file, django_capture_on_commit_callbacks
):
    from apps.workloads.services import workload_remove

    with django_capture_on_commit_callbacks(execute=True):
        upload_whole(agent(personas.agent_secret), archive_file)
        upload_whole(agent(personas.carol_agent_secret), archive_file)
    location = Archive.objects.get(owner=personas.carol).path
    with django_capture_on_commit_callbacks(execute=True):
        workload_remove(Workload.objects.get(owner=personas.alice, external_id="job-7"), by="test")
    assert object_store().exists(location)
    with django_capture_on_commit_callbacks(execute=True):
        workload_remove(Workload.objects.get(owner=personas.carol, external_id="job-7"), by="test")
    assert not object_store().exists(location)
