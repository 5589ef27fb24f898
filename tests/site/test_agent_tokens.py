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
