"""Single sign-on against a real OpenID Connect provider: django-oidc-provider serving from a second Django process
(tests/site/oidc_provider). The site runs the authorization-code flow with PKCE, verifies the RS256 ID token with
the provider's keys, and maps the identity to an ordinary account."""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from django.test import Client

from apps.accounts.models import Role, User
from tests.site.oidc_provider.server import Provider, running_provider

CALLBACK = "http://testserver/accounts/sso/callback/"


@pytest.fixture(scope="module")
def provider(tmp_path_factory) -> Iterator[Provider]:
    with running_provider(tmp_path_factory.mktemp("oidc-provider")) as provider:
        provider.allow_redirect(CALLBACK)
        yield provider


@pytest.fixture
def sso(settings, provider: Provider) -> Provider:
    provider.site_settings(settings)
    return provider


def sign_in_at_provider(site: Client, provider: Provider, username: str, password: str) -> httpx.Response:
    """Follow the browser's way: site → provider's sign-in → provider's authorize → back to the site."""
    start = site.get("/accounts/sso/")
    assert start.status_code == 302
    authorize = start["Location"]
    assert authorize.startswith(f"{provider.url}/openid/authorize?")
    assert "code_challenge=" in authorize
    with httpx.Client(base_url=provider.url) as person:
        signed_in = person.post("/login/", data={"username": username, "password": password, "next": authorize})
        assert signed_in.status_code == 302, signed_in.text
        back = person.get(authorize)
    assert back.status_code == 302, back.text
    callback = urlsplit(back.headers["location"])
    assert f"{callback.scheme}://{callback.netloc}{callback.path}" == CALLBACK
    return site.get(f"{callback.path}?{callback.query}")


def test_a_provider_user_signs_in_and_gets_an_ordinary_account(personas, sso):
    site = Client()
    finished = sign_in_at_provider(site, sso, "dana", "dana-password")
    assert finished.status_code == 302
    assert finished["Location"] == "/workloads/"
    dana = User.objects.get(username="dana")
    assert dana.role == Role.USER
    assert dana.email == "dana@example.org"
    assert dana.external_identity.startswith("oidc:")
    assert not dana.has_usable_password()
    assert site.get("/workloads/").context["user"] == dana
    assert site.get("/settings/").status_code in (403, 404)


def test_signing_in_again_finds_the_same_account(personas, sso):
    sign_in_at_provider(Client(), sso, "dana", "dana-password")
    sign_in_at_provider(Client(), sso, "dana", "dana-password")
    assert User.objects.filter(external_identity__startswith="oidc:").count() == 1


def test_a_provider_account_called_root_is_not_this_sites_root(personas, sso):
    site = Client()
    assert sign_in_at_provider(site, sso, "root", "root-password").status_code == 302
    signed_in = site.get("/workloads/").context["user"]
    assert signed_in != personas.root
    assert signed_in.username == "root-2"
    assert signed_in.role == Role.USER
    assert not signed_in.is_site_admin


def test_a_deactivated_account_stays_signed_out(personas, sso):
    sign_in_at_provider(Client(), sso, "dana", "dana-password")
    User.objects.filter(username="dana").update(is_active=False)
    site = Client()
    finished = sign_in_at_provider(site, sso, "dana", "dana-password")
    assert finished["Location"] == "/accounts/login/?sso=failed"
    assert "_auth_user_id" not in site.session
    assert "Single sign-on did not complete" in site.get(finished["Location"]).content.decode()


def test_a_callback_with_a_forged_state_signs_nobody_in(personas, sso):
    site = Client()
    site.get("/accounts/sso/")
    forged = site.get("/accounts/sso/callback/?code=made-up&state=not-the-one-sent")
    assert forged.status_code in (302, 400)
    assert "_auth_user_id" not in site.session
    assert not User.objects.filter(external_identity__startswith="oidc:").exists()


def test_the_sign_in_page_offers_single_sign_on_next_to_the_local_form(personas, sso):
    page = Client().get("/accounts/login/").content.decode()
    assert 'name="password"' in page
    assert 'href="/accounts/sso/"' in page
    assert "Sign in with Example SSO" in page


def test_without_configuration_there_is_no_single_sign_on(personas):
    assert "/accounts/sso/" not in Client().get("/accounts/login/").content.decode()
    assert Client().get("/accounts/sso/").status_code == 404
