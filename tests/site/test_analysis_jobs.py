"""Analysis jobs end to end in-process: request through the API or a page, Celery runs the task (eager), the
library analyses the workload's Parquet store, and the stored result is what users see."""

from __future__ import annotations

import json

import pytest
from django.test import Client
from django.urls import reverse

from tests.site.analysis_tables import hung_table, straggler_table, write_store


def client_of(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def api_url(workload) -> str:
    return reverse("api-analyses", kwargs={"workload_id": workload.pk})


def request_analysis(client: Client, workload, kind: str, **body):
    """POST an analysis request; on_commit callbacks run, so the (eager) task runs before this returns."""
    return client.post(api_url(workload), data=json.dumps({"kind": kind, **body}), content_type="application/json")


@pytest.fixture
def run_on_commit(django_capture_on_commit_callbacks):
    """Execute the task queued after commit, as a real request would."""

    def run(call):
        with django_capture_on_commit_callbacks(execute=True):
            return call()

    return run


def test_hang_analysis_names_the_rank_that_stopped_first(personas, data_dir, run_on_commit):
    write_store(data_dir, personas.workload.pk, hung_table(ranks=4, stuck_rank=2))
    response = run_on_commit(lambda: request_analysis(client_of(personas.bob), personas.workload, "hang"))
    assert response.status_code == 201
    job_id = response.json()["id"]
    detail = client_of(personas.alice).get(
        reverse("api-analysis-detail", kwargs={"workload_id": personas.workload.pk, "job_id": job_id})
    )
    job = detail.json()
    assert (job["state"], job["progress"]) == ("done", 100)
    assert job["result"]["verdict"] == "hang"
    assert job["result"]["root_cause_ranks"] == [2]
    page = client_of(personas.bob).get(
        reverse("analysis:job", kwargs={"workload_id": personas.workload.pk, "job_id": job_id})
    )
    html = page.content.decode()
    assert "<span data-verdict>hang</span>" in html
    assert "<strong data-root-cause-ranks>2</strong>" in html
    # The verdict comes before the evidence tables.
    assert html.index("data-verdict") < html.index("Stuck groups")


def test_straggler_analysis_blames_the_late_rank_and_estimates_the_slowdown(personas, data_dir, run_on_commit):
    write_store(data_dir, personas.workload.pk, straggler_table(late_rank=3))
    job = run_on_commit(lambda: request_analysis(client_of(personas.alice), personas.workload, "stragglers")).json()
    from apps.analysis.models import AnalysisJob

    stored = AnalysisJob.objects.get(pk=job["id"])
    assert stored.state == "done"
    assert stored.result["culprits"] == [3]
    assert stored.result["slowdown"]["ratio"] > 1.1
    ranks = {r["rank"]: r for r in stored.result["ranks"]}
    assert ranks[3]["waiting_ms"] < min(ranks[r]["waiting_ms"] for r in (0, 1, 2))
    html = (
        client_of(personas.alice)
        .get(reverse("analysis:job", kwargs={"workload_id": personas.workload.pk, "job_id": stored.pk}))
        .content.decode()
    )
    assert "<span data-culprits>3</span>" in html


def test_step_results_show_the_calibration_the_owner_applies(personas, data_dir, run_on_commit):
    write_store(data_dir, personas.workload.pk, straggler_table(steps=12))
    job = run_on_commit(
        lambda: request_analysis(
            client_of(personas.alice), personas.workload, "steps", parameters={"ignore_labels": True}
        )
    ).json()
    page_url = reverse("analysis:job", kwargs={"workload_id": personas.workload.pk, "job_id": job["id"]})
    alice = client_of(personas.alice)
    assert len(alice.get(page_url).context["report"]["rows"]) == 12
    calibrate = reverse("analysis:calibration", kwargs={"workload_id": personas.workload.pk})
    # bob only reads the workload: he may look, not recalibrate.
    assert client_of(personas.bob).post(calibrate, {"recovered": "0", "framework": "1000"}).status_code == 403
    assert alice.post(calibrate, {"recovered": "0", "framework": "1000", "job": str(job["id"])}).status_code == 302
    rows = client_of(personas.bob).get(page_url).context["report"]["rows"]
    assert [r["step"] for r in rows[:3]] == [1000, 1001, 1002]
    assert [r["recovered"] for r in rows[:3]] == [0, 1, 2]
    assert alice.post(calibrate, {"action": "clear"}).status_code == 302
    assert [r["step"] for r in alice.get(page_url).context["report"]["rows"][:2]] == [0, 1]


@pytest.mark.parametrize("body", [{"recovered": "-1", "framework": "3"}, {"recovered": "x", "framework": "3"}, {}])
def test_a_bad_calibration_is_refused_and_nothing_is_stored(personas, body):
    from apps.analysis.models import StepCalibration

    response = client_of(personas.alice).post(
        reverse("analysis:calibration", kwargs={"workload_id": personas.workload.pk}), body
    )
    assert response.status_code == 400
    assert not StepCalibration.objects.exists()


def test_performance_analysis_reports_bus_bandwidth_per_size(personas, data_dir, run_on_commit):
    write_store(data_dir, personas.workload.pk, straggler_table(buckets=3))
    job = run_on_commit(lambda: request_analysis(client_of(personas.alice), personas.workload, "perf")).json()
    page = client_of(personas.alice).get(
        reverse("analysis:job", kwargs={"workload_id": personas.workload.pk, "job_id": job["id"]})
    )
    rows = page.context["report"]["bandwidth"]
    assert {r["op"] for r in rows} == {"all_reduce"}
    assert len(rows) == 3  # three payload sizes
    assert all(r["busbw_gbs"] == pytest.approx(r["algbw_gbs"] * 1.5) for r in rows)  # 2(n-1)/n with n=4


def test_asking_again_for_a_current_result_runs_nothing_until_forced_or_the_store_changes(
    personas, data_dir, run_on_commit
):
    from apps.analysis.models import AnalysisJob

    write_store(data_dir, personas.workload.pk, hung_table())
    alice = client_of(personas.alice)
    first = run_on_commit(lambda: request_analysis(alice, personas.workload, "hang"))
    again = run_on_commit(lambda: request_analysis(alice, personas.workload, "hang", parameters={"silence_s": 60}))
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["id"] == first.json()["id"]
    job = AnalysisJob.objects.get()
    assert job.attempts == 1
    run_on_commit(lambda: request_analysis(alice, personas.workload, "hang", force=True))
    job.refresh_from_db()
    assert (job.attempts, job.state) == (2, "done")
    write_store(data_dir, personas.workload.pk, hung_table(ranks=6, stuck_rank=5))
    run_on_commit(lambda: request_analysis(alice, personas.workload, "hang"))
    job.refresh_from_db()
    assert (job.attempts, job.result["root_cause_ranks"]) == (3, [5])
    assert AnalysisJob.objects.count() == 1


def test_the_task_leaves_a_done_job_alone_unless_forced(personas, data_dir, run_on_commit):
    from apps.analysis.models import AnalysisJob
    from apps.analysis.tasks import run_analysis

    write_store(data_dir, personas.workload.pk, hung_table())
    run_on_commit(lambda: request_analysis(client_of(personas.alice), personas.workload, "hang"))
    job = AnalysisJob.objects.get()
    assert run_analysis.delay(job.pk).get() == "done"
    job.refresh_from_db()
    assert job.attempts == 1
    run_analysis.delay(job.pk, force=True).get()
    job.refresh_from_db()
    assert job.attempts == 2
    assert run_analysis.delay(job.pk + 1000).get() == "missing"


def test_a_workload_with_nothing_ingested_fails_the_job_with_a_reason(personas, run_on_commit):
    job = run_on_commit(lambda: request_analysis(client_of(personas.alice), personas.workload, "stragglers")).json()
    from apps.analysis.models import AnalysisJob

    stored = AnalysisJob.objects.get(pk=job["id"])
    assert stored.state == "failed"
    assert "no operations have been ingested" in stored.error


def test_a_corrupt_store_file_fails_the_job_with_a_reason(personas, data_dir, run_on_commit):
    from apps.analysis.models import AnalysisJob

    written = write_store(data_dir, personas.workload.pk, hung_table())
    written[0].write_bytes(b"PAR1 this is not parquet")
    run_on_commit(lambda: request_analysis(client_of(personas.alice), personas.workload, "hang"))
    job = AnalysisJob.objects.get()
    assert job.state == "failed"
    assert job.error
    assert job.result is None


BAD_REQUESTS = [
    ({"kind": "bogus"}, "kind"),
    ({}, "kind"),
    ({"kind": "hang", "parameters": {"silence_s": -1}}, "silence_s"),
    ({"kind": "hang", "parameters": {"silence_s": "soon"}}, "silence_s"),
    ({"kind": "hang", "parameters": {"silence_s": True}}, "silence_s"),
    ({"kind": "hang", "parameters": {"silence_s": "1e400"}}, "silence_s"),
    ({"kind": "hang", "parameters": {"min_gain": 0.1}}, "parameters"),
    ({"kind": "stragglers", "parameters": {"min_gain": 2}}, "min_gain"),
    ({"kind": "steps", "parameters": {"period_only": "maybe"}}, "period_only"),
    ({"kind": "perf", "parameters": [1, 2]}, "parameters"),
    ({"kind": "perf", "parameters": {f"k{i}": i for i in range(5000)}}, "parameters"),
    ({"kind": "perf", "parameters": {"slow_fraction": "9" * 5000}}, "slow_fraction"),
]


@pytest.mark.parametrize(("body", "field"), BAD_REQUESTS)
def test_bad_parameters_get_a_clear_400_and_create_nothing(personas, body, field):
    from apps.analysis.models import AnalysisJob

    response = client_of(personas.alice).post(
        api_url(personas.workload), data=json.dumps(body), content_type="application/json"
    )
    assert response.status_code == 400
    assert field in response.json()
    assert not AnalysisJob.objects.exists()


@pytest.mark.parametrize("raw", [b"{not json", b"[]", b'"hang"', b'{"kind": "hang", "parameters": {"silence_s": NaN}}'])
def test_malformed_request_bodies_get_400_and_create_nothing(personas, raw):
    from apps.analysis.models import AnalysisJob

    response = client_of(personas.alice).post(api_url(personas.workload), data=raw, content_type="application/json")
    assert response.status_code == 400
    assert not AnalysisJob.objects.exists()


def test_a_bad_form_on_the_page_answers_400_with_the_reason_and_creates_nothing(personas):
    from apps.analysis.models import AnalysisJob

    response = client_of(personas.alice).post(
        reverse("analysis:run", kwargs={"workload_id": personas.workload.pk}),
        {"kind": "hang", "hang-silence_s": "-5"},
    )
    assert response.status_code == 400
    assert "silence_s" in response.content.decode()
    assert not AnalysisJob.objects.exists()


def test_the_run_button_on_the_workload_page_starts_a_job_and_shows_it(personas, data_dir, run_on_commit):
    write_store(data_dir, personas.workload.pk, hung_table())
    bob = client_of(personas.bob)
    detail = bob.get(reverse("workloads:detail", kwargs={"workload_id": personas.workload.pk})).content.decode()
    assert 'data-run-analysis="hang"' in detail
    response = run_on_commit(
        lambda: bob.post(reverse("analysis:run", kwargs={"workload_id": personas.workload.pk}), {"kind": "hang"})
    )
    assert response.status_code == 302
    page = bob.get(response["Location"])
    assert page.context["job"].state == "done"
    detail = bob.get(reverse("workloads:detail", kwargs={"workload_id": personas.workload.pk})).content.decode()
    assert f'data-job-id="{page.context["job"].pk}"' in detail
