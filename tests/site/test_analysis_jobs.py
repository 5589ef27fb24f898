"""Analysis jobs end to end in-process: request through the API or a page, Celery runs the task (eager), the
library analyses the workload's Parquet store, and the stored result is what users see."""

from __future__ import annotations

import json

import pyarrow as pa
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
    # The per-step chart and the rank x step heat map are declared for the chart library.
    assert 'data-chart="stragglers-per-step"' in html
    assert 'data-chart="stragglers-heatmap"' in html
    assert '<script id="stragglers-heatmap" type="application/json">' in html


def test_straggler_analysis_of_evidence_without_timings_says_it_cannot_answer(personas, data_dir, run_on_commit):
    table = straggler_table(late_rank=3)
    no_times = pa.nulls(table.num_rows, pa.int64())
    for name in ("start_ns", "end_ns", "enqueue_ns"):
        if name in table.column_names:
            table = table.set_column(table.column_names.index(name), name, no_times)
    write_store(data_dir, personas.workload.pk, table)
    job = run_on_commit(lambda: request_analysis(client_of(personas.alice), personas.workload, "stragglers")).json()
    from apps.analysis.models import AnalysisJob

    stored = AnalysisJob.objects.get(pk=job["id"])
    assert stored.state == "done"
    assert stored.result["evidence"].startswith("insufficient")
    assert stored.result["culprits"] == []
    html = (
        client_of(personas.alice)
        .get(reverse("analysis:job", kwargs={"workload_id": personas.workload.pk, "job_id": stored.pk}))
        .content.decode()
    )
    assert "Cannot answer" in html
    assert "no operation timings" in html
    assert "No straggler" not in html
    assert "Slowdown against the ideal" not in html


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


def test_a_job_whose_store_cannot_be_read_is_retried_then_fails_saying_so(
    personas, data_dir, run_on_commit, monkeypatch
):
    from apps.analysis import services
    from apps.analysis.models import AnalysisJob

    write_store(data_dir, personas.workload.pk, hung_table())

    def unreadable(*args, **kwargs):
        raise OSError("input/output error")

    from apps.analysis import partitions
    from apps.analysis.tasks import run_analysis

    monkeypatch.setattr(services, "load_operations", unreadable)  # a run in one task
    # Every kind runs partitioned (tests/site/test_partitioned_runs.py): a stragglers run reads the store when it
    # is planned, in the job's task, which retries then gives up.
    monkeypatch.setattr(partitions, "_read", unreadable)
    request_analysis(client_of(personas.alice), personas.workload, "stragglers")  # queued (not run: no commit)
    job = AnalysisJob.objects.get()
    # In-process retries need eager propagation off (else the first Retry surfaces as an exception).
    from comminsight_site.celery import app

    monkeypatch.setattr(app.conf, "CELERY_TASK_EAGER_PROPAGATES", False)
    monkeypatch.setattr(app.conf, "task_eager_propagates", False)
    assert run_analysis.apply(args=(job.pk,)).get() == "failed"
    job.refresh_from_db()
    assert job.state == "failed"
    assert job.attempts == 4  # the first run and three retries
    assert "gave up after 4 attempts: input/output error" in job.error


def test_a_job_that_runs_past_its_time_limit_fails_saying_so(personas, data_dir, run_on_commit, monkeypatch):
    from celery.exceptions import SoftTimeLimitExceeded

    from apps.analysis import services
    from apps.analysis.models import AnalysisJob

    write_store(data_dir, personas.workload.pk, hung_table())

    def too_slow(*args, **kwargs):
        raise SoftTimeLimitExceeded()

    from apps.analysis import partitions

    monkeypatch.setitem(services.RUNNERS, "stragglers", too_slow)  # a run in one task
    monkeypatch.setattr(partitions, "_stragglers_start", too_slow)  # partitioned: planned in the job's task
    run_on_commit(lambda: request_analysis(client_of(personas.alice), personas.workload, "stragglers"))
    job = AnalysisJob.objects.get()
    assert job.state == "failed"
    assert "time limit" in job.error


def test_operators_can_queue_analyses_again_from_the_command_line(personas, data_dir):
    from io import StringIO

    from django.core.management import CommandError, call_command

    from apps.analysis.models import AnalysisJob

    write_store(data_dir, personas.workload.pk, hung_table())
    out = StringIO()
    call_command("reanalyse", str(personas.workload.pk), "--kind", "hang", stdout=out)
    assert f"workload {personas.workload.pk} hang: job" in out.getvalue()
    assert AnalysisJob.objects.get().kind == "hang"
    with pytest.raises(CommandError, match="no workload with id 999999"):
        call_command("reanalyse", "999999")


def test_a_workload_ingested_from_an_agent_archive_can_be_analysed(personas, tmp_path, data_dir, run_on_commit):
    """The store ingest writes (not one built by this test) reads back whole: 16 operations of ranks 2 and 3."""
    from apps.workloads import ingest
    from apps.workloads.models import Workload
    from apps.workloads.uploads import archive_register
    from tests.site.archives import sha256_of, valid_archive

    path = valid_archive(tmp_path, ranks=(2, 3))
    archive, _ = archive_register(
        source_path=path, sha256=sha256_of(path), size=path.stat().st_size, owner=personas.alice, filename=path.name
    )
    ingest.archive_ingest(archive.pk)
    workload = Workload.objects.get(owner=personas.alice, external_id="job-7")
    job = run_on_commit(lambda: request_analysis(client_of(personas.alice), workload, "hang")).json()
    from apps.analysis.models import AnalysisJob

    stored = AnalysisJob.objects.get(pk=job["id"])
    assert stored.state == "done", stored.error
    assert stored.result["verdict"] in ("no_hang", "hang", "insufficient_evidence")
    trace = client_of(personas.alice).get(reverse("analysis:trace_download", kwargs={"workload_id": workload.pk}))
    events = json.loads(b"".join(trace.streaming_content))
    events = events["traceEvents"] if isinstance(events, dict) else events
    assert len([e for e in events if e.get("ph") in ("X", "i")]) == 16


def test_a_large_step_result_keeps_per_step_summaries_instead_of_every_rank(
    personas, data_dir, run_on_commit, monkeypatch
):
    from apps.analysis import partitions
    from apps.analysis.models import AnalysisJob

    monkeypatch.setattr(partitions, "MAX_STEP_RANK_DETAILS", 10)  # 12 steps x 4 ranks is "large" here
    write_store(data_dir, personas.workload.pk, straggler_table(steps=12))
    run_on_commit(lambda: request_analysis(client_of(personas.alice), personas.workload, "steps"))
    job = AnalysisJob.objects.get()
    assert job.result["per_rank_details"] is False
    assert all("ranks" not in step for step in job.result["steps"])
    rows = (
        client_of(personas.alice)
        .get(reverse("analysis:job", kwargs={"workload_id": personas.workload.pk, "job_id": job.pk}))
        .context["report"]["rows"]
    )
    assert len(rows) == 12
    assert {row["ranks"] for row in rows} == {4}
    assert rows[1]["exposed_wait_ms"] == pytest.approx(15.0)  # three ranks wait 20 ms for the late one


def test_a_forced_rerun_by_a_read_share_keeps_who_requested_the_analysis(personas, data_dir, run_on_commit):
    write_store(data_dir, personas.workload.pk, hung_table(ranks=4, stuck_rank=2))
    run_on_commit(lambda: request_analysis(client_of(personas.alice), personas.workload, "hang"))
    rerun = run_on_commit(lambda: request_analysis(client_of(personas.bob), personas.workload, "hang", force=True))
    assert rerun.status_code in (200, 201)
    from apps.analysis.models import AnalysisJob

    job = AnalysisJob.objects.get(workload=personas.workload, kind="hang")
    assert job.created_by == personas.alice
