"""End to end with the simulator: a job runs, the real agent reports it live, and its monitoring dashboard shows
each rank's step times while the job still runs (the live step engine on the node, no archive analysis)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.timeout(900),  # sixteen simulated ranks start slowly on a shared 2-core machine
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        not (Path(__file__).resolve().parents[2] / "native/profiler/build/libnccl-profiler-comminsight.so").exists(),
        reason="profiler plugin not built (make -C native/profiler)",
    ),
]

# Long enough that the agent's engine warms up (512 operations per GPU) and steps become final well before the
# hang; the hang ends the job (the demo's own ending).
PLAN = {
    "steps": 80,
    "step_ms": 150.0,
    "straggler_from_step": 2,
    "hang_step": 75,
    "hang_s": 4.0,
    "agent_hang_floor_s": 2.0,
    "archive_interval_s": 30.0,  # step times reach the dashboard from heartbeats, not from archives
}


def test_the_dashboard_shows_step_times_per_rank_while_the_job_runs(
    live_server, page, personas, data_dir, celery_eager, settings, artifacts
):
    from apps.monitoring.models import Point, Series
    from apps.workloads.demo import demo_running
    from apps.workloads.models import Workload, WorkloadStatus
    from tests.conftest import PASSWORD

    settings.DEMO_PLAN = PLAN
    Workload.objects.all().delete()
    page.goto(live_server.url + "/accounts/login/")
    page.fill("#id_username", "root")
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url("**/workloads/")
    page.click("#run-demo")
    try:
        page.wait_for_url("**/workloads/*/")
        workload = Workload.objects.get()
        seen_while = None
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if Point.objects.filter(series__workload=workload, series__metric="step_duration_s").exists():
                seen_while = Workload.objects.get(pk=workload.pk).status
                break
            time.sleep(0.5)
        assert seen_while == WorkloadStatus.RUNNING, "step times must arrive while the job runs"
    finally:
        deadline = time.monotonic() + 240
        while demo_running() and time.monotonic() < deadline:
            time.sleep(1)
    # The page once the job is over (the test server ingests archives in its request thread while it runs).
    page.goto(f"{live_server.url}/workloads/{workload.pk}/monitoring/?range=1h")
    page.wait_for_selector(f'[data-chart="chart-{workload.pk}-step_duration_s"][data-chart-ready] svg', timeout=120_000)
    page.screenshot(path=artifacts / "40-live-step-times.png", full_page=True)
    ranks = set(Series.objects.filter(workload=workload, metric="step_duration_s").values_list("key", flat=True))
    assert ranks
    assert ranks <= {str(r) for r in range(16)}
