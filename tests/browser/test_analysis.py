"""A signed-in user runs a hang analysis from the workload page and sees the verdict; "Open in Perfetto" hands
the trace to (a stand-in for) ui.perfetto.dev through the PING/PONG postMessage handshake."""

from __future__ import annotations

import re

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

# Stands in for ui.perfetto.dev: answers PING with PONG, then shows what it was handed in its title.
FAKE_PERFETTO = """<!doctype html><title>waiting</title><script>
window.addEventListener("message", (e) => {
  if (e.data === "PING") { e.source.postMessage("PONG", e.origin); return; }
  if (e.data && e.data.perfetto) {
    const text = new TextDecoder().decode(e.data.perfetto.buffer);
    document.title = "got " + e.data.perfetto.title + " " + JSON.parse(text).traceEvents.length;
  }
});
</script>"""


def test_running_a_hang_analysis_shows_the_verdict_and_the_trace_opens_in_perfetto(
    live_server, page, sign_in, personas, data_dir, celery_eager, artifacts
):
    from tests.site.analysis_tables import hung_table, write_store

    write_store(data_dir, personas.workload.pk, hung_table(ranks=4, stuck_rank=2))
    sign_in("bob")
    page.goto(f"{live_server.url}/workloads/{personas.workload.pk}/")
    page.click('[data-run-analysis="hang"]')
    page.wait_for_url(re.compile(r".*/analyses/\d+/$"))
    page.wait_for_selector("[data-verdict]")
    assert page.inner_text("[data-verdict]") == "hang"
    assert page.inner_text("[data-root-cause-ranks]") == "2"
    page.screenshot(path=artifacts / "10-hang-verdict.png", full_page=True)
    page.goto(f"{live_server.url}/workloads/{personas.workload.pk}/")
    assert "Done" in page.inner_text("#analysis")
    page.screenshot(path=artifacts / "12-workload-analysis.png", full_page=True)

    page.context.route(
        re.compile(r"^https://ui\.perfetto\.dev/.*"),
        lambda route: route.fulfill(status=200, content_type="text/html", body=FAKE_PERFETTO),
    )
    page.goto(f"{live_server.url}/workloads/{personas.workload.pk}/trace/")
    with page.context.expect_page() as popup_info:
        page.click("[data-perfetto-open]")
    popup = popup_info.value
    popup.wait_for_function("document.title.startsWith('got ')", timeout=15_000)
    title = popup.title()
    assert title.startswith("got llama-pretrain ")
    assert int(title.rsplit(" ", 1)[1]) > 40  # the workload's 43 operations plus track metadata
    page.wait_for_function("document.querySelector('[data-perfetto-status]').textContent.includes('handed')")
    page.bring_to_front()  # a background tab does not paint: bring it back for the screenshot
    page.screenshot(path=artifacts / "11-trace-export.png", full_page=True)


def test_straggler_and_step_pages_show_the_culprit_and_the_calibrated_steps(
    live_server, page, sign_in, personas, data_dir, celery_eager, artifacts
):
    from apps.workloads.models import Workload
    from tests.site.analysis_tables import straggler_table, write_store

    workload = Workload.objects.create(name="bert-ddp", external_id="job-3", owner=personas.alice)
    write_store(data_dir, workload.pk, straggler_table(late_rank=3))
    sign_in("alice")
    page.goto(f"{live_server.url}/workloads/{workload.pk}/")
    page.click('[data-run-analysis="stragglers"]')
    page.wait_for_selector("[data-culprits]")
    assert page.inner_text("[data-culprits]") == "3"
    page.screenshot(path=artifacts / "13-stragglers.png", full_page=True)

    page.goto(f"{live_server.url}/workloads/{workload.pk}/")
    page.click('[data-run-analysis="steps"]')
    page.wait_for_selector("[data-steps-table]")
    page.fill("input[name=recovered]", "0")
    page.fill("input[name=framework]", "500")
    page.click("button[value=apply]")
    page.wait_for_selector("text=Calibration applied")
    first_step = page.inner_text("[data-steps-table] tbody tr:first-child td:first-child")
    assert first_step == "500"
    page.screenshot(path=artifacts / "14-steps-calibrated.png", full_page=True)


def test_open_in_perfetto_gives_up_with_advice_when_perfetto_is_unreachable(
    live_server, page, sign_in, personas, data_dir, artifacts
):
    from tests.site.analysis_tables import hung_table, write_store

    write_store(data_dir, personas.workload.pk, hung_table(ranks=4, stuck_rank=2))
    page.context.route(re.compile(r"^https://ui\.perfetto\.dev/.*"), lambda route: route.abort("internetdisconnected"))
    sign_in("alice")
    page.clock.install()
    page.goto(f"{live_server.url}/workloads/{personas.workload.pk}/trace/")
    with page.context.expect_page():
        page.click("[data-perfetto-open]")
    page.wait_for_function("document.querySelector('[data-perfetto-status]').textContent.includes('Waiting')")
    page.clock.run_for("00:25")
    page.wait_for_function("document.querySelector('[data-perfetto-status]').textContent.includes('did not answer')")
    assert "Download the trace" in page.inner_text("[data-perfetto-status]")
    page.bring_to_front()
    page.screenshot(path=artifacts / "13-perfetto-unreachable.png", full_page=True)
