"""Agent tokens: hashed at rest, shown once, revocable, owner-bound; the machine API's authentication."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.urls import reverse
from rest_framework.test import APIRequestFactory

from apps.accounts.authentication import AgentTokenAuthentication
from apps.accounts.models import AgentToken
from apps.accounts.services import agent_token_authenticate


def test_token_is_stored_only_as_a_hash(personas):
    stored = AgentToken.objects.get(pk=personas.agent_token.pk)
    secret_part = personas.agent_secret.rsplit("_", 1)[-1]
    assert secret_part not in stored.secret_sha256
    assert personas.agent_secret.startswith(f"ci_{stored.prefix}_")


def test_token_authenticates_as_its_owner(personas):
    token = agent_token_authenticate(personas.agent_secret)
    assert token is not None
    assert token.owner == personas.alice


@pytest.mark.parametrize(
    "presented", ["", "ci_", "ci_deadbeef_wrong", "Bearer", "ci_" + "x" * 500, "not-a-token", "ci__secret"]
)
def test_malformed_or_wrong_tokens_authenticate_nobody(personas, presented):
    assert agent_token_authenticate(presented) is None


def test_revoked_token_is_refused_by_the_api_authentication(personas):
    request = APIRequestFactory().get("/", HTTP_AUTHORIZATION=f"Bearer {personas.agent_secret}")
    assert AgentTokenAuthentication().authenticate(request)[0] == personas.alice
    call_command("agent_token", "revoke", personas.agent_token.prefix)
    from rest_framework.exceptions import AuthenticationFailed

    with pytest.raises(AuthenticationFailed, match="revoked"):
        AgentTokenAuthentication().authenticate(request)


def test_token_of_a_deactivated_owner_is_refused(personas):
    personas.alice.is_active = False
    personas.alice.save()
    assert agent_token_authenticate(personas.agent_secret) is None


def test_command_creates_a_token_printing_the_secret_once(personas, capsys):
    call_command("agent_token", "create", "--owner", "bob", "--name", "node-pool-b")
    secret = capsys.readouterr().out.strip()
    assert agent_token_authenticate(secret).owner == personas.bob
    call_command("agent_token", "list")
    listing = capsys.readouterr().out
    assert "node-pool-b" in listing
    assert secret not in listing


def test_command_refuses_an_unknown_owner_and_a_duplicate_name(personas):
    with pytest.raises(CommandError, match="no user named"):
        call_command("agent_token", "create", "--owner", "nobody", "--name", "x")
    with pytest.raises(CommandError, match="already has a token"):
        call_command("agent_token", "create", "--owner", "alice", "--name", "node-pool-a")


def test_token_page_shows_the_secret_once_and_never_again(client, personas):
    client.force_login(personas.bob)
    created = client.post(reverse("accounts:tokens"), {"name": "pool-b"})
    assert created.status_code == 201
    secret = created.context["issued"].secret
    assert secret.encode() in created.content
    assert created["Cache-Control"] == "no-store"
    assert secret.encode() not in client.get(reverse("accounts:tokens")).content


def test_user_cannot_revoke_someone_elses_token(client, personas):
    client.force_login(personas.carol)
    response = client.delete(reverse("api-agent-token-detail", args=[personas.agent_token.pk]))
    assert response.status_code == 404
    assert agent_token_authenticate(personas.agent_secret) is not None


# --- The token rows a server process keeps for AGENT_TOKEN_CACHE_S (services.TokenRows) ---


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def kept_rows(monkeypatch, settings):
    """The process's kept token rows on a clock the test moves."""
    from apps.accounts import services

    settings.AGENT_TOKEN_CACHE_S = 2.0
    clock = _Clock()
    rows = services.TokenRows(lambda: settings.AGENT_TOKEN_CACHE_S, clock)
    monkeypatch.setattr(services, "_token_rows", rows)
    return clock


def test_a_token_revoked_by_this_process_is_refused_at_once(personas, kept_rows, django_assert_num_queries):
    assert agent_token_authenticate(personas.agent_secret) is not None  # records its use: the row is read again
    assert agent_token_authenticate(personas.agent_secret) is not None
    with django_assert_num_queries(0):  # kept: no statement
        assert agent_token_authenticate(personas.agent_secret).owner == personas.alice
    call_command("agent_token", "revoke", personas.agent_token.prefix)
    assert agent_token_authenticate(personas.agent_secret) is None


def test_an_owner_deactivated_by_this_process_is_refused_at_once(personas, kept_rows):
    assert agent_token_authenticate(personas.agent_secret) is not None
    personas.alice.is_active = False
    personas.alice.save()
    assert agent_token_authenticate(personas.agent_secret) is None


def test_a_token_revoked_by_another_process_is_refused_within_the_bound(personas, kept_rows):
    from django.utils import timezone

    assert agent_token_authenticate(personas.agent_secret) is not None
    # Another process's revocation: the row changes, no signal reaches this one.
    AgentToken.objects.filter(pk=personas.agent_token.pk).update(revoked_at=timezone.now())
    kept_rows.now += 2.0
    assert agent_token_authenticate(personas.agent_secret) is None


def test_an_owner_deactivated_by_another_process_is_refused_within_the_bound(personas, kept_rows):
    from apps.accounts.models import User

    assert agent_token_authenticate(personas.agent_secret) is not None
    User.objects.filter(pk=personas.alice.pk).update(is_active=False)
    kept_rows.now += 2.0
    assert agent_token_authenticate(personas.agent_secret) is None


def test_with_no_keeping_every_request_reads_the_token(personas, kept_rows, settings):
    from django.utils import timezone

    settings.AGENT_TOKEN_CACHE_S = 0
    assert agent_token_authenticate(personas.agent_secret) is not None
    AgentToken.objects.filter(pk=personas.agent_token.pk).update(revoked_at=timezone.now())
    assert agent_token_authenticate(personas.agent_secret) is None


@pytest.mark.parametrize("suffix", ["x", "", "0" * 64])
def test_a_kept_token_still_checks_the_secret_every_time(personas, kept_rows, suffix):
    assert agent_token_authenticate(personas.agent_secret) is not None
    prefix_part = personas.agent_secret.rsplit("_", 1)[0]
    assert agent_token_authenticate(f"{prefix_part}_{suffix}") is None
    assert agent_token_authenticate(personas.agent_secret[:-1] + "!") is None


def test_unknown_prefixes_are_not_kept(personas, kept_rows):
    from apps.accounts import services

    for i in range(50):
        assert agent_token_authenticate(f"ci_nosuch{i}_secret") is None
    assert services._token_rows._rows == {}


def test_a_row_read_before_a_revocation_is_not_kept_after_it(personas, kept_rows):
    from apps.accounts import services

    generation = services._token_rows.generation
    services.agent_token_rows_clear()  # a revocation saved between the read and the keep
    services._token_rows.keep(personas.agent_token.prefix, ("stale",), generation)
    assert services._token_rows.get(personas.agent_token.prefix) is None
