"""A user opens a running workload's monitoring dashboard, sees its charts, and watches a new heartbeat arrive;
the straggler page shows the NIC counters of the culprit's node."""

from __future__ import annotations

import pytest
from django.utils import timezone

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def fill_last_quarter_hour(workload, ranks: int = 16) -> None:
    """Heartbeat-like series for the last 15 minutes: step times (rank 5 slower), GPUs, one NIC with errors."""
    from apps.monitoring.services import Sample, points_record

    now_ms = int(timezone.now().timestamp() * 1000)
    samples = []
    for i in range(180):
        t = now_ms - (180 - i) * 5000
        for r in range(ranks):
            samples.append(
                Sample("step_duration_s", str(r), f"n{r // 8}", t, 1.4 + (0.35 if r == 5 else 0) + (i % 7) * 0.01)
            )
        for g in range(4):
            samples.append(Sample("gpu_util_pct", f"n0/gpu{g}", "n0", t, 90.0 - g * 5 + (i % 5)))
        samples.append(Sample("nic_rx_bytes_per_s", "n0/mlx5_0:1", "n0", t, 2.2e10 - (8e9 if 100 < i < 120 else 0)))
        samples.append(Sample("nic_errors_per_s", "n0/mlx5_0:1", "n0", t, 4.0 if 100 < i < 120 else 0.0))
        samples.append(Sample("lagging_ranks", "all", "", t, 1.0 if 100 < i < 120 else 0.0))
    points_record(workload.pk, samples)


def test_the_dashboard_draws_the_charts_and_follows_new_heartbeats(live_server, page, sign_in, personas, artifacts):
    import httpx

    from apps.workloads.models import WorkloadStatus

    workload = personas.workload
    workload.status = WorkloadStatus.RUNNING
    workload.save()
    fill_last_quarter_hour(workload)
    page.clock.install()  # lets the test move the page's polling timer forward
    sign_in("bob")  # bob sees alice's workload through a read share

    page.goto(f"{live_server.url}/monitoring/?range=1h")
    page.wait_for_selector(f'[data-chart="chart-{workload.pk}-step_duration_s"][data-chart-ready] svg')
    assert workload.name in page.inner_text("main")
    page.screenshot(path=artifacts / "20-monitoring-running.png", full_page=True)

    page.click(f"text={workload.name}")
    page.wait_for_selector(f'[data-chart="chart-{workload.pk}-gpu_util_pct"][data-chart-ready] svg')
    step_chart = page.locator(f'[data-chart="chart-{workload.pk}-step_duration_s"]')
    assert "min / median / max across 16 ranks" in step_chart.inner_text()
    assert "n0/gpu3" in page.locator(f'[data-chart="chart-{workload.pk}-gpu_util_pct"]').inner_text()
    page.screenshot(path=artifacts / "21-monitoring-workload.png", full_page=True)

    # The agent reports a step of 9.5 s on rank 0: the open page picks it up without a reload.
    end_ns = int(timezone.now().timestamp() * 1e9)
    heartbeat = {
        "workload_id": workload.external_id,
        "node": "n0",
        "steps": [{"rank": 0, "step": 900, "end_ns": end_ns, "duration_s": 9.5}],
        "agent": {"records_per_s": 50000.0, "dropped_records": 12, "inflight_ops": 3, "cpu_pct": 4.0},
    }
    sent = httpx.post(
        live_server.url + "/api/v1/ingest/live/",
        json=heartbeat,
        headers={"Authorization": f"Bearer {personas.agent_secret}"},
    )
    assert sent.status_code == 202
    page.clock.fast_forward("00:35")
    page.wait_for_function("document.querySelector('[data-monitoring-updated]').textContent.startsWith('Updated')")
    page.wait_for_function(
        f"document.querySelector('[data-chart=\"chart-{workload.pk}-dropped_records\"]').textContent.includes('n0')"
    )
    page.screenshot(path=artifacts / "22-monitoring-live-update.png", full_page=True)


def test_the_straggler_page_shows_the_nic_counters_of_the_culprits_node(
    live_server, page, sign_in, personas, artifacts
):
    from apps.analysis.models import AnalysisJob, JobState
    from apps.workloads.models import Node, Rank

    workload = personas.workload
    fill_last_quarter_hour(workload)
    now_ns = int(timezone.now().timestamp() * 1e9)
    workload.first_ns, workload.last_ns = now_ns - 900 * 10**9, now_ns
    workload.save()
    for name, ranks in (("n0", range(8)), ("n1", range(8, 16))):
        node = Node.objects.create(workload=workload, name=name)
        Rank.objects.bulk_create([Rank(workload=workload, node=node, rank=r) for r in ranks])
    job = AnalysisJob.objects.create(
        workload=workload,
        kind="stragglers",
        parameters={},
        parameters_key="k",
        state=JobState.DONE,
        result={
            "culprits": [5],
            "culprit_groups": [{"group": "rank=5", "ranks": [5], "saves_ms_per_step": 310.0}],
            "ranks": [],
            "slowdown": {
                "steps": 180,
                "observed_step_ms": 1750.0,
                "estimated_without_culprits_ms": 1440.0,
                "ratio": 1.21,
            },
            "waiting": [],
            "per_step": [],
            "step_source": "labels",
        },
    )
    sign_in("alice")
    page.goto(f"{live_server.url}/workloads/{workload.pk}/analyses/{job.pk}/")
    verdict = page.inner_text("[data-nic-verdict]")
    assert verdict.startswith("NIC counters move with this slowness")
    assert "n0 mlx5_0:1" in verdict
    page.locator("#nic-correlation").scroll_into_view_if_needed()
    page.screenshot(path=artifacts / "23-straggler-nic-counters.png", full_page=True)
