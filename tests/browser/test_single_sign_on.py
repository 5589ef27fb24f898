"""Single sign-on in a real browser: the sign-in page's SSO button, the provider's own sign-in page (a real
OpenID Connect provider in a second process), and back to the workload list as a new regular user."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.site.oidc_provider.server import Provider, running_provider

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def provider(tmp_path) -> Iterator[Provider]:
    with running_provider(tmp_path) as provider:
        yield provider


def test_a_person_signs_in_through_the_provider_and_lands_on_the_workload_list(
    live_server, page, personas, provider, settings, artifacts
):
    from apps.accounts.models import Role, User

    provider.allow_redirect(f"{live_server.url}/accounts/sso/callback/")
    provider.site_settings(settings)
    page.goto(live_server.url + "/accounts/login/")
    page.screenshot(path=artifacts / "50-sign-in-with-sso.png", full_page=True)
    page.click("#sso-sign-in")
    page.wait_for_url(f"{provider.url}/login/**")
    page.fill("#username", "dana")
    page.fill("#password", "dana-password")
    page.click("#provider-sign-in")
    page.wait_for_url(f"{live_server.url}/workloads/")
    page.screenshot(path=artifacts / "51-signed-in-through-sso.png", full_page=True)
    assert "dana" in page.inner_text("header")
    assert "No workloads yet" in page.inner_text("main")
    dana = User.objects.get(username="dana")
    assert dana.role == Role.USER
    assert "Users" not in page.inner_text("header nav")
    assert "Password" not in page.inner_text("header")  # no local password to change
