"""The pages a user manages a workload with, in a real browser: share and unshare, delete results, delete the
workload, pictures on result pages, System Settings' background jobs and shared concurrency, About."""

from __future__ import annotations

import re

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_owner_shares_unshares_deletes_results_and_then_the_workload(
    live_server, page, sign_in, personas, data_dir, celery_eager, artifacts
):
    from apps.analysis.models import AnalysisJob
    from apps.workloads.models import Workload, WorkloadShare
    from tests.site.analysis_tables import straggler_table, write_store

    write_store(data_dir, personas.workload.pk, straggler_table(buckets=3))
    sign_in("alice")
    page.goto(f"{live_server.url}/workloads/{personas.workload.pk}/")
    page.click("text=Share or unshare…")
    page.fill("#id_username", "carol")
    page.select_option("#id_level", "manage")
    page.click("#share-form button[type=submit]")
    assert "Shared with carol (manage)" in page.inner_text(".messages")
    assert "carol" in page.inner_text("#share-list")
    page.screenshot(path=artifacts / "30-sharing.png", full_page=True)
    page.click("#share-list tr:has-text('bob') button")
    assert "bob no longer sees" in page.inner_text(".messages")
    assert not WorkloadShare.objects.filter(user=personas.bob).exists()

    # A picture next to the numbers on the performance page.
    page.goto(f"{live_server.url}/workloads/{personas.workload.pk}/")
    page.click('[data-run-analysis="perf"]')
    page.wait_for_url(re.compile(r".*/analyses/\d+/$"))
    page.wait_for_selector("[data-chart='bandwidth-chart'][data-chart-ready]", timeout=60_000)
    page.screenshot(path=artifacts / "31-perf-picture.png", full_page=True)
    assert AnalysisJob.objects.filter(workload=personas.workload).count() == 1

    page.goto(f"{live_server.url}/workloads/{personas.workload.pk}/analyses/")
    page.click("text=Delete results…")
    page.screenshot(path=artifacts / "32-delete-results.png", full_page=True)
    page.click("#confirm-delete-results")
    assert "Deleted 1 analysis result" in page.inner_text(".messages")
    assert not AnalysisJob.objects.filter(workload=personas.workload).exists()

    page.goto(f"{live_server.url}/workloads/{personas.workload.pk}/")
    page.click("text=Delete…")
    page.fill("#id_confirm", "not the name")
    page.click("#delete-workload button[type=submit]")
    assert "Type the workload's name exactly" in page.inner_text("#delete-workload")
    page.screenshot(path=artifacts / "33-delete-workload.png", full_page=True)
    page.fill("#id_confirm", personas.workload.name)
    page.click("#delete-workload button[type=submit]")
    page.wait_for_url("**/workloads/")
    assert "were deleted" in page.inner_text(".messages")
    assert not Workload.objects.filter(pk=personas.workload.pk).exists()


def test_administrator_sets_shared_concurrency_sees_background_jobs_and_reads_about(
    live_server, page, sign_in, personas, data_dir, celery_eager, tmp_path, artifacts
):
    from apps.analysis.models import AnalysisJob
    from apps.workloads.models import Archive, SystemSettings
    from apps.workloads.uploads import archive_key
    from comminsight_site.objectstore import object_store
    from tests.site.archives import sha256_of, valid_archive

    bytes_at = valid_archive(tmp_path, workload="job-waiting")
    sha256 = sha256_of(bytes_at)
    archive = Archive.objects.create(  # stored, its ingest not queued (no task runs before the admin acts)
        sha256=sha256,
        size=bytes_at.stat().st_size,
        filename="waiting.tar.zst",
        owner=personas.alice,
        path=object_store().put_file(bytes_at, archive_key(sha256)),
    )
    job = AnalysisJob.objects.create(
        workload=personas.workload, kind="hang", parameters_key="x", created_by=personas.bob
    )
    sign_in("admin")
    page.click("nav >> text=Settings")
    page.fill("#id_max_running_analyses", "2")
    page.click("form.stack button[type=submit]")
    assert "Settings saved." in page.inner_text(".messages")
    assert SystemSettings.load().max_running_analyses == 2
    assert "llama-pretrain" in page.inner_text("#background-jobs")
    page.screenshot(path=artifacts / "34-settings-jobs.png", full_page=True)
    page.click("#background-jobs button:has-text('Cancel')")
    assert "cancelled" in page.inner_text(".messages")
    job.refresh_from_db()
    assert job.state == "failed"
    assert "waiting.tar.zst" in page.inner_text("#background-jobs tr[data-kind=ingest]")
    page.click("#background-jobs tr[data-kind=ingest] button:has-text('Cancel')")
    assert "Ingest of waiting.tar.zst cancelled" in page.inner_text(".messages")
    assert "Ingest cancelled by admin." in page.inner_text("#background-jobs tr[data-kind=ingest]")
    archive.refresh_from_db()
    assert archive.state == "quarantined"
    page.screenshot(path=artifacts / "36-settings-requeue.png", full_page=True)
    page.click("#background-jobs tr[data-kind=ingest] button:has-text('Re-queue')")
    assert "Ingest of waiting.tar.zst re-queued." in page.inner_text(".messages")
    archive.refresh_from_db()  # the test server ran the queued ingest in the request
    assert (archive.state, archive.requeued_by, archive.workload.external_id) == ("ingested", "admin", "job-waiting")
    assert "waiting.tar.zst" not in page.inner_text("#background-jobs")

    page.click("nav >> text=About")
    page.wait_for_selector("[data-chart='architecture-chart'][data-chart-ready]")
    assert "Version" in page.inner_text("#version")
    page.screenshot(path=artifacts / "35-about.png", full_page=True)
    response = page.goto(f"{live_server.url}/workloads/{personas.other_workload.pk}/sharing/")
    assert response is not None
    assert response.status == 200  # administrators manage every workload
