"""The demo job from a new site's empty list, in a real browser: the real plugin driven by the simulator, a real
agent uploading to the live server, the workload turning hung without a reload, then the analyses naming the
hung rank and the straggler."""

from __future__ import annotations

import pytest

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
]

# Short enough for a test, long enough that the job is seen running before it hangs (margins for a busy machine).
PLAN = {
    "steps": 14,
    "step_ms": 150.0,
    "straggler_from_step": 2,
    "hang_step": 10,
    "hang_s": 20.0,
    "agent_hang_floor_s": 2.0,
    "archive_interval_s": 2.0,
}


# The number in the workload facts' "ranks" stat equals the argument.
RANKS_SHOWN = """(expected) => [...document.querySelectorAll('#workload-facts .stat')].some(
    (stat) => stat.querySelector('span')?.textContent.trim() === 'ranks'
        && stat.querySelector('strong').textContent.trim() === expected)"""


def test_root_runs_the_demo_and_watches_it_hang_then_reads_the_analyses(
    page, live_server, sign_in, demo_job, artifacts
):
    from apps.analysis.models import AnalysisJob

    sign_in("root")
    page.screenshot(path=artifacts / "20-demo-offer.png", full_page=True)
    with demo_job(PLAN) as workload:
        assert "The demo job is starting" in page.inner_text(".messages")
        # The open page follows the job without a reload (live regions and status badge poll every 15 s here:
        # the test server has no WebSockets).
        page.wait_for_function(
            "document.querySelector('#workload-status').textContent.trim() === 'Hung'", timeout=150_000
        )
        page.screenshot(path=artifacts / "21-demo-hung.png", full_page=True)
        # Archives arrive node by node and rank by rank: the open page shows all sixteen ranks once they are in.
        page.wait_for_function(RANKS_SHOWN, arg="16", timeout=180_000)
    workload.refresh_from_db()
    assert workload.status == "hung", "a job aborted while hung must stay hung"
    assert workload.ranks.count() == 16
    jobs = {job.kind: job for job in AnalysisJob.objects.filter(workload=workload)}
    assert {kind: job.state for kind, job in jobs.items()} == dict.fromkeys(
        ["hang", "stragglers", "steps", "perf"], "done"
    )
    assert jobs["hang"].result["root_cause_ranks"] == [5]
    assert 6 in jobs["stragglers"].result["culprits"]

    page.reload()
    page.screenshot(path=artifacts / "22-demo-finished.png", full_page=True)
    page.click(f"#analysis a[href$='/analyses/{jobs['hang'].pk}/']")
    assert "rank" in page.inner_text("main").lower()
    page.screenshot(path=artifacts / "23-demo-hang.png", full_page=True)
    page.goto(f"{live_server.url}/workloads/{workload.pk}/topology/")
    page.wait_for_selector("[data-chart='topology-chart'][data-chart-ready]")
    page.screenshot(path=artifacts / "24-demo-topology.png", full_page=True)
