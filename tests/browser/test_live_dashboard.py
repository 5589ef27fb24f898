"""End to end with the simulator: a job runs, the real agent reports it live, and its monitoring dashboard shows
each rank's step times while the job still runs (the live step engine on the node, no archive analysis)."""

from __future__ import annotations

import time

import pytest

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.timeout(900),  # sixteen simulated ranks start slowly on a shared 2-core machine
    pytest.mark.django_db(transaction=True),
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


def test_the_dashboard_shows_step_times_per_rank_while_the_job_runs(page, live_server, sign_in, demo_job, artifacts):
    from apps.monitoring.models import Point, Series
    from apps.workloads.models import Workload, WorkloadStatus

    sign_in("root")
    with demo_job(PLAN) as workload:
        seen_while = None
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if Point.objects.filter(series__workload=workload, series__metric="step_duration_s").exists():
                seen_while = Workload.objects.get(pk=workload.pk).status
                break
            time.sleep(0.5)
        assert seen_while == WorkloadStatus.RUNNING, "step times must arrive while the job runs"
    # The page once the job is over (the test server ingests archives in its request thread while it runs).
    page.goto(f"{live_server.url}/workloads/{workload.pk}/monitoring/?range=1h")
    page.wait_for_selector(f'[data-chart="chart-{workload.pk}-step_duration_s"][data-chart-ready] svg', timeout=120_000)
    page.screenshot(path=artifacts / "40-live-step-times.png", full_page=True)
    ranks = set(Series.objects.filter(workload=workload, metric="step_duration_s").values_list("key", flat=True))
    assert ranks
    assert ranks <= {str(r) for r in range(16)}
