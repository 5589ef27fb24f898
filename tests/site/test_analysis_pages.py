"""Result pages read as findings: sizes not bucket numbers, rounded bandwidths, no self-links, a threshold that is
stated, pictures next to the tables, and errors on the site's own pages."""

from __future__ import annotations

from django.test import Client
from django.urls import reverse

from apps.analysis.models import AnalysisJob, JobState
from apps.workloads.models import Communicator

PERF_RESULT = {
    "bandwidth": [
        {"comm_id": "0x00000000000000aa", "op": "all_reduce", "bucket": 20, "n": 4, "samples": 36,
         "bytes": 1048576.0, "algbw_gbs": 3.25148, "busbw_gbs": 4.87722, "reference_busbw_gbs": 24.386150011,
         "efficiency": 0.2},
    ],
    "slow_communicators": [
        {"comm_id": "0x00000000000000aa", "op": "all_reduce", "bucket": 20, "n": 4, "samples": 36,
         "bytes": 1048576.0, "busbw_gbs": 4.877220011822, "busbw_p10_gbs": 3.2, "reference_busbw_gbs": 24.386150011,
         "efficiency": 0.2000012345},
    ],
    "slow_ranks": [],
    "slow_links": [
        {"src": 1, "dst": 1, "bucket": 20, "samples": 32, "busbw_gbs": 0.07, "reference_busbw_gbs": 28.0,
         "efficiency": 0.0025},
        {"src": 1, "dst": 6, "bucket": 20, "samples": 32, "busbw_gbs": 0.0548, "reference_busbw_gbs": 28.0,
         "efficiency": 0.00195},
    ],
}  # fmt: skip


def page_of(personas, kind: str, result: dict, parameters: dict | None = None) -> str:
    Communicator.objects.create(
        workload=personas.workload, comm_hash="0x00000000000000aa", comm_name="dp1", nranks=4, ranks=[1, 3, 5, 7]
    )
    job = AnalysisJob.objects.create(
        workload=personas.workload,
        kind=kind,
        parameters=parameters or {},
        parameters_key=kind,
        state=JobState.DONE,
        result=result,
    )
    client = Client()
    client.force_login(personas.alice)
    response = client.get(reverse("analysis:job", kwargs={"workload_id": personas.workload.pk, "job_id": job.pk}))
    assert response.status_code == 200
    return response.content.decode()


def test_slow_communicators_show_names_sizes_rounded_bandwidth_and_percentages(personas):
    html = page_of(personas, "perf", PERF_RESULT)
    flagged = html.split("Slow communicators", 1)[1].split("</section>", 1)[0]
    assert "<td>dp1</td>" in flagged
    assert "1 MiB" in flagged
    assert "4.88" in flagged
    assert "20%" in flagged
    assert "4.877220011822" not in flagged
    assert "busbw_p10_gbs" not in flagged
    assert "<th>bucket</th>" not in flagged


def test_slow_links_leave_out_a_rank_talking_to_itself(personas):
    html = page_of(personas, "perf", PERF_RESULT)
    links = html.split('id="slow-links"', 1)[1].split("</section>", 1)[0]
    assert "rank 1 → rank 6" in links
    assert "rank 1 → rank 1" not in links


def test_nothing_flagged_states_the_threshold_the_job_used(personas):
    html = page_of(personas, "perf", {"bandwidth": PERF_RESULT["bandwidth"]}, parameters={"slow_fraction": 0.5})
    assert "at least 50% of the best bus bandwidth" in html
    assert "below %" not in html


def test_perf_page_plots_bus_bandwidth_against_message_size(personas):
    html = page_of(personas, "perf", PERF_RESULT)
    assert 'data-chart="bandwidth-chart"' in html
    assert 'id="bandwidth-chart"' in html


def test_hang_page_draws_who_waits_on_whom_with_the_root_cause_highlighted(personas):
    result = {
        "verdict": "hang",
        "summary": "Hang: progress stopped first at rank(s) 5.",
        "root_cause_ranks": [5],
        "stuck_groups": [{"group_id": "0xaa", "group_desc": "dp1", "op": "all_gather", "seq": 8}],
        "chain": [{"rank": 5, "depth": 0, "waits_on": None, "blocks": []}, {"rank": 1, "depth": 1, "waits_on": 5}],
    }
    html = page_of(personas, "hang", result)
    assert 'data-chart="hang-chain-chart"' in html
    option = html.split('id="hang-chain-chart" type="application/json">', 1)[1].split("</script>", 1)[0]
    assert '"source": "1", "target": "5"' in option
    assert "never completed dp1 all_gather seq 8" in option


def test_a_bad_calibration_answers_on_the_sites_own_page(personas):
    client = Client()
    client.force_login(personas.alice)
    response = client.post(
        reverse("analysis:calibration", kwargs={"workload_id": personas.workload.pk}),
        {"recovered": "x", "framework": "3"},
    )
    assert response.status_code == 400
    assert response["Content-Type"].startswith("text/html")
    assert "Bad calibration" in response.content.decode()
    assert 'class="topbar"' in response.content.decode()


def test_deleting_results_removes_finished_analyses_and_keeps_running_ones_and_the_evidence(personas):
    from apps.workloads.models import Workload

    done = AnalysisJob.objects.create(
        workload=personas.workload, kind="hang", parameters_key="a", state=JobState.DONE, result={"verdict": "hang"}
    )
    running = AnalysisJob.objects.create(
        workload=personas.workload, kind="perf", parameters_key="b", state=JobState.RUNNING
    )
    client = Client()
    client.force_login(personas.alice)
    url = reverse("analysis:delete_results", kwargs={"workload_id": personas.workload.pk})
    assert "Delete the results" in client.get(url).content.decode()
    response = client.post(url, follow=True)
    assert "Deleted 1 analysis result." in response.content.decode()
    assert not AnalysisJob.objects.filter(pk=done.pk).exists()
    assert AnalysisJob.objects.filter(pk=running.pk).exists()
    assert Workload.objects.filter(pk=personas.workload.pk).exists()


def test_a_read_share_cannot_delete_results(personas):
    AnalysisJob.objects.create(workload=personas.workload, kind="hang", parameters_key="a", state=JobState.DONE)
    client = Client()
    client.force_login(personas.bob)
    response = client.post(reverse("analysis:delete_results", kwargs={"workload_id": personas.workload.pk}))
    assert response.status_code == 403
    assert AnalysisJob.objects.count() == 1


def test_administrators_see_background_jobs_and_a_cancelled_queued_job_never_runs(personas):
    from apps.analysis.services import analysis_run

    job = AnalysisJob.objects.create(
        workload=personas.workload, kind="hang", parameters_key="a", created_by=personas.bob
    )
    client = Client()
    client.force_login(personas.admin)
    page = client.get(reverse("workloads:settings")).content.decode()
    jobs = page.split('id="background-jobs"', 1)[1]
    assert "llama-pretrain" in jobs
    assert "bob" in jobs
    client.post(reverse("workloads:job_cancel", kwargs={"job_id": job.pk}))
    job.refresh_from_db()
    assert job.state == JobState.FAILED
    assert job.error == "Cancelled by admin."
    assert analysis_run(job.pk) == JobState.FAILED
    job.refresh_from_db()
    assert job.error == "Cancelled by admin."


def test_the_shared_limit_keeps_a_job_queued_while_others_run_and_lets_it_start_when_a_slot_frees(personas):
    from apps.analysis.services import DEFERRED, analysis_run
    from apps.workloads.models import SystemSettings

    client = Client()
    client.force_login(personas.root)
    client.post(reverse("workloads:settings"), {"archive_path": "", "max_running_analyses": "1"})
    assert SystemSettings.load().max_running_analyses == 1
    running = AnalysisJob.objects.create(
        workload=personas.workload, kind="perf", parameters_key="a", state=JobState.RUNNING
    )
    waiting = AnalysisJob.objects.create(workload=personas.workload, kind="hang", parameters_key="b")
    assert analysis_run(waiting.pk) == DEFERRED
    waiting.refresh_from_db()
    assert waiting.state == JobState.QUEUED
    AnalysisJob.objects.filter(pk=running.pk).update(state=JobState.DONE)
    assert analysis_run(waiting.pk) != DEFERRED
