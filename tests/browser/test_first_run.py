"""A new operator's first minutes, in a real browser: initialise with the token, sign in, see the empty list."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PASSWORD = "a root password"


def test_operator_initialises_signs_in_and_sees_the_empty_workload_list(live_server, page, data_dir, artifacts):
    from apps.accounts import services

    token_path = services.bootstrap_ensure()
    token = token_path.read_text().strip()

    page.goto(live_server.url + "/")
    assert page.url.endswith("/init/")
    page.screenshot(path=artifacts / "01-initialise.png", full_page=True)
    page.fill("#id_token", token)
    page.fill("#id_password1", PASSWORD)
    page.fill("#id_password2", PASSWORD)
    page.click("button[type=submit]")

    page.wait_for_url("**/accounts/login/")
    assert "CommInsight is initialised" in page.inner_text(".messages")
    assert not token_path.exists()
    page.fill("#id_username", "root")
    page.fill("#id_password", PASSWORD)
    page.screenshot(path=artifacts / "02-sign-in.png", full_page=True)
    page.click("button[type=submit]")

    page.wait_for_url("**/workloads/")
    assert page.inner_text("#empty-workloads h2") == "No workloads yet"
    assert "COMMINSIGHT_AGENT_TOKEN" in page.inner_text("#empty-workloads")
    # The built stylesheet is served: the top bar is dark, not the browser default.
    background = page.eval_on_selector(".topbar", "e => getComputedStyle(e).backgroundColor")
    assert background == "rgb(17, 24, 39)"
    page.screenshot(path=artifacts / "03-empty-workloads.png", full_page=True)

    page.click("nav >> text=Users")
    page.fill("#id_username", "alice")
    page.fill("#id_password", "alice's password")
    page.click("form.stack button[type=submit]")
    assert "User alice created." in page.inner_text(".messages")
    page.click("text=Make administrator")
    assert "alice is now administrator." in page.inner_text(".messages")
    page.screenshot(path=artifacts / "08-users.png", full_page=True)
    page.click("nav >> text=Settings")
    page.fill("#id_archive_path", "/srv/shared")
    page.click("form.stack button[type=submit]")
    assert "Settings saved." in page.inner_text(".messages")
    page.screenshot(path=artifacts / "09-settings.png", full_page=True)

    # The initialisation page no longer exists.
    response = page.goto(live_server.url + "/init/")
    assert response is not None
    assert response.status == 404


def test_agent_token_page_shows_a_new_token_once(live_server, page, personas, artifacts):
    from tests.conftest import PASSWORD as PERSONA_PASSWORD

    page.goto(live_server.url + "/accounts/login/")
    page.fill("#id_username", "alice")
    page.fill("#id_password", PERSONA_PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url("**/workloads/")
    page.screenshot(path=artifacts / "04-workloads.png", full_page=True)
    page.goto(live_server.url + "/accounts/tokens/")
    page.fill("#id_name", "node-pool-b")
    page.click("form.stack button[type=submit]")
    secret = page.inner_text("#issued-token .secret")
    assert secret.startswith("ci_")
    page.screenshot(path=artifacts / "05-token-created.png", full_page=True)
    page.goto(live_server.url + "/accounts/tokens/")
    assert secret not in page.content()
