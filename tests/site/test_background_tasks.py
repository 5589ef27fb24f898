"""System Settings' background jobs: one list of analyses and archive ingests from the database, with Cancel."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from apps.analysis.models import AnalysisJob, JobState
from apps.workloads import ingest
from apps.workloads.models import Archive, ArchiveSource, ArchiveState, Workload
from apps.workloads.selectors import background_tasks
from apps.workloads.services import WorkloadPermissionDenied, archive_ingest_cancel
from apps.workloads.tasks import ingest_archive
from apps.workloads.uploads import archive_register
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
