"""System Settings' background jobs: one list of analyses and archive ingests from the database, with Cancel, and
Re-queue for a quarantined or cancelled ingest (page and API)."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from apps.accounts.models import User
from apps.analysis.models import AnalysisJob, JobState
from apps.workloads import ingest
from apps.workloads.models import Archive, ArchiveSource, ArchiveState, Workload
from apps.workloads.selectors import background_tasks
from apps.workloads.services import WorkloadPermissionDenied, archive_ingest_cancel, archive_ingest_requeue
from apps.workloads.tasks import ingest_archive
from apps.workloads.uploads import archive_key, archive_register
from comminsight_site.objectstore import object_store
from tests.site.archives import sha256_of, valid_archive


def stored(tmp_path: Path, owner, name: str = "a") -> Archive:
    """An uploaded archive of ``owner`` waiting for ingest (its task is queued when the test's transaction
    would commit, which it never does: the test decides when the worker runs)."""
    folder = tmp_path / name
    folder.mkdir()
    path = valid_archive(folder, workload=f"job-{name}")
    archive, _ = archive_register(
        source_path=path, sha256=sha256_of(path), size=path.stat().st_size, owner=owner, filename=f"{name}.tar.zst"
    )
    return archive


def admin_client(personas) -> Client:
    client = Client()
    client.force_login(personas.admin)
    return client


def rows(page: str) -> dict[tuple[str, str], str]:
    """The background jobs table's rows by (kind, state)."""
    table = page.split('id="background-tasks"', 1)[1].split("</table>", 1)[0]
    found = re.findall(r'<tr data-kind="(\w+)" data-state="(\w+)">(.*?)</tr>', table, re.S)
    return {(kind, state): html for kind, state, html in found}


def test_the_list_shows_analyses_and_ingests_with_state_age_and_owner(personas, tmp_path):
    AnalysisJob.objects.create(workload=personas.workload, kind="hang", parameters_key="a", created_by=personas.bob)
    queued = stored(tmp_path, personas.alice, "queued")
    running = stored(tmp_path, personas.carol, "running")
    Archive.objects.filter(pk=running.pk).update(lease_owner="f" * 32, lease_until=timezone.now() + timedelta(60))
    failed = stored(tmp_path, personas.alice, "failed")
    Archive.objects.filter(pk=failed.pk).update(
        state=ArchiveState.QUARANTINED, reason="manifest is not JSON", source=ArchiveSource.DISCOVERY
    )
    Archive.objects.filter(pk=queued.pk).update(created_at=timezone.now() - timedelta(hours=3))

    page = admin_client(personas).get(reverse("workloads:settings")).content.decode()
    found = rows(page)

    assert set(found) == {("analysis", "queued"), ("ingest", "queued"), ("ingest", "running"), ("ingest", "failed")}
    assert "llama-pretrain" in found["analysis", "queued"]
    assert "bob" in found["analysis", "queued"]
    assert "queued.tar.zst" in found["ingest", "queued"]
    assert "alice" in found["ingest", "queued"]
    assert "3\xa0hours" in found["ingest", "queued"]
    assert "running.tar.zst" in found["ingest", "running"]
    assert "carol" in found["ingest", "running"]
    assert "Ingest (discovered)" in found["ingest", "failed"]
    assert "manifest is not JSON" in found["ingest", "failed"]
    assert "Cancel" in found["analysis", "queued"]
    assert "Cancel" in found["ingest", "queued"]
    assert "Cancel" not in found["ingest", "running"]
    assert "Cancel" not in found["ingest", "failed"]
    assert "Re-queue" in found["ingest", "failed"]
    assert not any("Re-queue" in html for key, html in found.items() if key != ("ingest", "failed"))


def test_the_selector_lists_newest_first_and_leaves_out_finished_work(personas, tmp_path):
    done = stored(tmp_path, personas.alice, "done")
    Archive.objects.filter(pk=done.pk).update(state=ArchiveState.INGESTED)
    AnalysisJob.objects.create(workload=personas.workload, kind="perf", parameters_key="d", state=JobState.DONE)
    older = stored(tmp_path, personas.alice, "older")
    Archive.objects.filter(pk=older.pk).update(created_at=timezone.now() - timedelta(days=1))
    job = AnalysisJob.objects.create(workload=personas.workload, kind="hang", parameters_key="a")
    assert [(task.kind, task.pk) for task in background_tasks()] == [("analysis", job.pk), ("ingest", older.pk)]


def test_a_cancelled_queued_ingest_is_quarantined_for_its_owner_with_its_bytes_kept_and_the_worker_skips_it(
    personas, tmp_path
):
    archive = stored(tmp_path, personas.alice)
    client = admin_client(personas)
    response = client.post(reverse("workloads:ingest_cancel", kwargs={"archive_id": archive.pk}), follow=True)
    assert "Ingest of a.tar.zst cancelled" in response.content.decode()

    archive.refresh_from_db()
    assert (archive.state, archive.reason) == (ArchiveState.QUARANTINED, "Ingest cancelled by admin.")
    assert object_store().exists(archive.path)  # never deleted: moved aside like any refused archive

    assert ingest_archive.delay(archive.pk).get() == ArchiveState.QUARANTINED  # the worker's task skips it
    archive.refresh_from_db()
    assert (archive.attempts, archive.workload) == (0, None)
    assert not Workload.objects.filter(external_id="job-a").exists()

    owner = Client()
    owner.force_login(personas.alice)
    assert "Ingest cancelled by admin." in owner.get(reverse("workloads:list")).content.decode()


def test_an_ingest_held_by_a_running_attempt_is_not_cancelled(personas, tmp_path):
    archive = stored(tmp_path, personas.alice)
    Archive.objects.filter(pk=archive.pk).update(lease_owner="f" * 32, lease_until=timezone.now() + timedelta(60))
    response = admin_client(personas).post(
        reverse("workloads:ingest_cancel", kwargs={"archive_id": archive.pk}), follow=True
    )
    assert "was not waiting for ingest" in response.content.decode()
    archive.refresh_from_db()
    assert (archive.state, archive.reason) == (ArchiveState.STORED, "")


def test_an_ingest_waiting_for_a_retry_is_cancelled(personas, tmp_path):
    archive = stored(tmp_path, personas.alice)
    Archive.objects.filter(pk=archive.pk).update(
        attempts=1, reason="attempt 1 failed: OSError", lease_until=timezone.now() + timedelta(minutes=5)
    )
    assert archive_ingest_cancel(actor=personas.root, archive=archive)
    assert ingest.archive_ingest(archive.pk) == ArchiveState.QUARANTINED
    archive.refresh_from_db()
    assert (archive.state, archive.reason, archive.attempts) == (
        ArchiveState.QUARANTINED,
        "Ingest cancelled by root.",
        1,
    )


@pytest.mark.parametrize("persona", ["alice", "bob", "carol"])
def test_only_administrators_cancel_an_ingest(personas, tmp_path, persona):
    archive = stored(tmp_path, personas.alice)
    user = getattr(personas, persona)
    client = Client()
    client.force_login(user)
    assert client.post(reverse("workloads:ingest_cancel", kwargs={"archive_id": archive.pk})).status_code == 404
    with pytest.raises(WorkloadPermissionDenied):
        archive_ingest_cancel(actor=user, archive=archive)
    archive.refresh_from_db()
    assert archive.state == ArchiveState.STORED
    assert ingest.archive_ingest(archive.pk) == ArchiveState.INGESTED


def requeue_url(archive: Archive) -> str:
    return reverse("api-archive-requeue", kwargs={"archive_id": archive.pk})


def cancelled(tmp_path: Path, owner, name: str = "a") -> Archive:
    archive = stored(tmp_path, owner, name)
    assert archive_ingest_cancel(actor=User.objects.get(username="admin"), archive=archive)
    archive.refresh_from_db()
    return archive


def test_a_cancelled_ingest_requeued_through_the_api_is_ingested_and_says_who_requeued_it(
    personas, tmp_path, django_capture_on_commit_callbacks, each_storage_backend
):
    archive = cancelled(tmp_path, personas.alice)
    assert archive.path.endswith(f"quarantine/{archive.sha256}")

    client = admin_client(personas)  # signing in saves the user, which has its own commit hook
    with django_capture_on_commit_callbacks() as queued:
        response = client.post(requeue_url(archive))
    assert response.status_code == 200
    body = response.json()
    assert (body["state"], body["attempts"], body["requeued_by"]) == ("stored", 0, "admin")
    assert body["reason"] == "Re-queued by admin (quarantined before: Ingest cancelled by admin.)"
    archive.refresh_from_db()
    assert archive.path == object_store().location(archive_key(archive.sha256))  # back out of quarantine/
    assert object_store().exists(archive.path)

    assert len(queued) == 1
    queued[0]()  # the ingest task queued on commit
    archive.refresh_from_db()
    assert (archive.state, archive.reason, archive.attempts) == (ArchiveState.INGESTED, "", 1)
    assert archive.workload == Workload.objects.get(external_id="job-a", owner=personas.alice)
    assert (archive.requeued_by, archive.requeued_at is not None) == ("admin", True)


def test_requeueing_twice_queues_the_ingest_once(personas, tmp_path, django_capture_on_commit_callbacks):
    archive = cancelled(tmp_path, personas.alice)
    client = admin_client(personas)
    with django_capture_on_commit_callbacks() as queued:
        first = client.post(requeue_url(archive))
        second = client.post(requeue_url(archive))
    assert (first.status_code, second.status_code) == (200, 200)
    assert first.json() == second.json()
    assert len(queued) == 1


def test_a_requeued_archive_that_keeps_failing_is_quarantined_again_after_the_bounded_attempts(
    personas, tmp_path, settings, monkeypatch
):
    archive = stored(tmp_path, personas.alice)
    Archive.objects.filter(pk=archive.pk).update(
        state=ArchiveState.QUARANTINED, attempts=settings.INGEST_MAX_ATTEMPTS, reason="ingest gave up after 5 attempts"
    )
    assert archive_ingest_requeue(actor=personas.root, archive=archive)
    archive.refresh_from_db()
    assert (archive.attempts, archive.requeued_by) == (0, "root")

    def broken(_archive):
        raise RuntimeError("worker bug")

    monkeypatch.setattr(ingest, "stage_archive", broken)
    outcomes = [ingest.archive_ingest(archive.pk) for _ in range(settings.INGEST_MAX_ATTEMPTS + 2)]
    assert outcomes == [ArchiveState.STORED] * (settings.INGEST_MAX_ATTEMPTS - 1) + [ArchiveState.QUARANTINED] * 3
    archive.refresh_from_db()
    assert archive.attempts == settings.INGEST_MAX_ATTEMPTS
    assert archive.reason.startswith(f"ingest gave up after {settings.INGEST_MAX_ATTEMPTS} attempts")


def test_a_discovered_archive_whose_file_is_gone_is_not_requeued(personas, tmp_path):
    path = valid_archive(tmp_path, workload="job-gone")
    archive = Archive.objects.create(
        sha256=sha256_of(path),
        size=path.stat().st_size,
        filename=path.name,
        owner=personas.alice,
        source=ArchiveSource.DISCOVERY,
        path=str(path),
        state=ArchiveState.QUARANTINED,
        reason="Ingest cancelled by admin.",
    )
    path.unlink()
    response = admin_client(personas).post(requeue_url(archive))
    assert response.status_code == 409
    assert "gone or changed" in response.json()["detail"]
    page = admin_client(personas).post(
        reverse("workloads:ingest_requeue", kwargs={"archive_id": archive.pk}), follow=True
    )
    assert "Not re-queued: the stored bytes of" in page.content.decode()
    archive.refresh_from_db()
    assert (archive.state, archive.reason, archive.requeued_by) == (
        ArchiveState.QUARANTINED,
        "Ingest cancelled by admin.",
        "",
    )


def test_an_ingested_archive_is_not_requeued(personas, tmp_path):
    archive = stored(tmp_path, personas.alice)
    assert ingest.archive_ingest(archive.pk) == ArchiveState.INGESTED
    response = admin_client(personas).post(requeue_url(archive))
    assert response.status_code == 409
    assert response.json() == {"detail": "a.tar.zst is already ingested"}


def test_requeueing_one_owners_archive_brings_back_the_bytes_another_owner_shares(personas, tmp_path):
    alices = cancelled(tmp_path, personas.alice)
    carols = Archive.objects.create(
        sha256=alices.sha256,
        size=alices.size,
        filename="same.tar.zst",
        owner=personas.carol,
        path=alices.path,
        state=ArchiveState.QUARANTINED,
        reason="Ingest cancelled by admin.",
    )
    assert archive_ingest_requeue(actor=personas.admin, archive=alices)
    carols.refresh_from_db()
    alices.refresh_from_db()
    assert carols.path == alices.path == object_store().location(archive_key(alices.sha256))
    assert carols.state == ArchiveState.QUARANTINED  # only the archive asked for goes back in the queue


def test_the_page_requeues_a_cancelled_ingest(personas, tmp_path):
    archive = cancelled(tmp_path, personas.alice)
    response = admin_client(personas).post(
        reverse("workloads:ingest_requeue", kwargs={"archive_id": archive.pk}), follow=True
    )
    assert "Ingest of a.tar.zst re-queued." in response.content.decode()
    assert "Re-queued by admin" in rows(response.content.decode())["ingest", "queued"]


@pytest.mark.parametrize(("persona", "api_status"), [("alice", 403), ("bob", 404), ("carol", 404)])
def test_only_administrators_requeue_an_ingest(personas, tmp_path, persona, api_status):
    archive = cancelled(tmp_path, personas.alice)
    user = getattr(personas, persona)
    client = Client()
    client.force_login(user)
    assert client.post(requeue_url(archive)).status_code == api_status
    assert client.post(reverse("workloads:ingest_requeue", kwargs={"archive_id": archive.pk})).status_code == 404
    with pytest.raises(WorkloadPermissionDenied):
        archive_ingest_requeue(actor=user, archive=archive)
    archive.refresh_from_db()
    assert (archive.state, archive.requeued_by) == (ArchiveState.QUARANTINED, "")
