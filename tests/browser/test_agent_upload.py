"""The real agent client uploads an archive to a live site; its owner sees nodes and communicators."""

from __future__ import annotations

import hashlib

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_agent_upload_appears_on_the_owners_workload_page(
    live_server, page, personas, data_dir, celery_eager, tmp_path, artifacts
):
    from comminsight.agent.config import load_config
    from comminsight.agent.providers import SpoolEntry
    from comminsight.agent.uploader import SiteProvider
    from tests.conftest import PASSWORD
    from tests.site.archives import valid_archive

    (tmp_path / "home").mkdir()
    config = load_config(
        env={
            "COMMINSIGHT_AGENT_SERVER_URL": live_server.url,
            "COMMINSIGHT_AGENT_TOKEN": personas.agent_secret,
            "COMMINSIGHT_AGENT_UPLOAD_CHUNK": "512",  # several chunks for a small archive
        },
        home=tmp_path / "home",
    )
    path = valid_archive(tmp_path, workload="llama-70b-run3", ranks=(0, 1))
    data = path.read_bytes()
    entry = SpoolEntry(
        path=path,
        sha256=hashlib.sha256(data).hexdigest(),
        size=len(data),
        created_ns=0,
        workload_id="llama-70b-run3",
        node="10.0.0.1",
    )
    SiteProvider(config).deliver(entry)  # raises unless the site confirmed this sha256

    page.clock.install()  # lets the test move the page's polling timer forward
    page.goto(live_server.url + "/accounts/login/")
    page.fill("#id_username", "alice")
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url("**/workloads/")
    page.screenshot(path=artifacts / "06-workloads-with-data.png", full_page=True)
    page.click("text=llama-70b-run3")
    assert "10.0.0.1" in page.inner_text("#nodes")
    assert "gpu-host-a" in page.inner_text("#nodes")
    communicators = page.inner_text("#communicators")
    assert "0x1234abcd5678ef00" in communicators
    assert "0, 1" in communicators
    assert "Ingested" in page.inner_text("#archives")
    assert page.inner_text("#workload-status") == "No live data"

    # The agent reports a hang; the open page picks it up on its next poll, without a reload.
    import httpx

    heartbeat = {
        "workload_id": "llama-70b-run3",
        "node": "10.0.0.1",
        "communicators": [{"comm_hash": "0x1234abcd5678ef00", "last_completed_seq": 3, "lagging_ranks": [1]}],
        "hang": [{"comm_hash": "0x1234abcd5678ef00", "ranks": [1]}],
    }
    sent = httpx.post(
        live_server.url + "/api/v1/ingest/live/",
        json=heartbeat,
        headers={"Authorization": f"Bearer {personas.agent_secret}"},
    )
    assert sent.status_code == 202
    page.clock.fast_forward("00:16")
    page.wait_for_function("document.querySelector('#workload-status').dataset.status === 'hung'")
    assert page.inner_text("#workload-status") == "Hung"
    page.screenshot(path=artifacts / "07-workload-detail.png", full_page=True)
