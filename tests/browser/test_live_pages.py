"""Open pages follow the server: the workload page shows an archive's ranks once it is ingested, and the list shows
a workload that appeared meanwhile — without a reload. (The test server has no WebSockets: the pages take their
15-second fallback, moved forward by the page clock; tests/site/test_websocket.py covers the sockets' messages.)"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_open_workload_page_and_list_follow_ingest_without_a_reload(
    live_server, browser, personas, data_dir, celery_eager, tmp_path, artifacts
):
    from apps.accounts.services import agent_token_authenticate
    from apps.workloads import uploads
    from tests.conftest import PASSWORD
    from tests.site.archives import sha256_of, valid_archive

    context = browser.new_context()
    detail, listing = context.new_page(), context.new_page()
    for page in (detail, listing):
        page.clock.install()
    detail.goto(live_server.url + "/accounts/login/")
    detail.fill("#id_username", "alice")
    detail.fill("#id_password", PASSWORD)
    detail.click("button[type=submit]")
    detail.wait_for_url("**/workloads/")
    detail.goto(f"{live_server.url}/workloads/{personas.workload.pk}/")
    listing.goto(live_server.url + "/workloads/")
    assert detail.is_visible("#no-archives")
    assert "job-7" not in listing.inner_text("#workloads-region")

    token = agent_token_authenticate(personas.agent_secret)
    for workload in ("job-1", "job-7"):
        (tmp_path / workload).mkdir()
        path = valid_archive(tmp_path / workload, workload=workload, ranks=(0, 1))
        with open(path, "rb") as body:
            uploads.upload_oneshot(
                token=token, sha256=sha256_of(path), filename=path.name, body=body, length=path.stat().st_size
            )

    for page in (detail, listing):
        page.clock.fast_forward("00:16")
    detail.wait_for_function("!document.querySelector('#no-archives')")
    stats = detail.inner_text("#workload-facts .stats")
    assert "2\nranks" in stats
    assert "1\narchives" in stats
    assert "Ingested" in detail.inner_text("#archives")
    listing.wait_for_function("document.querySelector('#workloads-region').textContent.includes('job-7')")
    detail.screenshot(path=artifacts / "40-live-detail-after-ingest.png", full_page=True)
    listing.screenshot(path=artifacts / "41-live-list-new-workload.png", full_page=True)
    context.close()
