"""Sign-in, sign-out, throttling, CSRF, password change, roles and user creation."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from apps.accounts.models import Role, User
from tests.conftest import PASSWORD


def sign_in(client: Client, username: str, password: str):
    return client.post(reverse("accounts:login"), {"username": username, "password": password})


def test_user_signs_in_with_the_right_password_and_lands_on_workloads(client, personas):
    response = sign_in(client, "alice", PASSWORD)
    assert response.status_code == 302
    assert response["Location"] == reverse("workloads:list")
    assert client.get(reverse("workloads:list")).status_code == 200


def test_wrong_password_is_refused_with_the_form_shown_again(client, personas):
    response = sign_in(client, "alice", "wrong password")
    assert response.status_code == 200
    assert b"Please enter a correct username and password" in response.content
    assert "_auth_user_id" not in client.session


def test_repeated_wrong_passwords_lock_the_account_out_even_for_the_right_one(client, personas, settings):
    for _ in range(settings.AXES_FAILURE_LIMIT):
        sign_in(client, "alice", "wrong password")
    response = sign_in(client, "alice", PASSWORD)
    assert response.status_code == 429
    assert b"Too many failed sign-ins" in response.content
    assert "_auth_user_id" not in client.session


def test_sign_in_form_without_csrf_token_is_refused(personas):
    client = Client(enforce_csrf_checks=True)
    response = sign_in(client, "alice", PASSWORD)
    assert response.status_code == 403
    assert "_auth_user_id" not in client.session


def test_session_api_writes_need_the_csrf_token(personas):
    client = Client(enforce_csrf_checks=True)
    client.force_login(personas.alice)
    url = reverse("api-agent-tokens")
    refused = client.post(url, {"name": "pool-b"}, content_type="application/json")
    assert refused.status_code == 403
    assert "CSRF" in refused.json()["detail"]
    client.get(reverse("accounts:tokens"))  # sets the csrftoken cookie
    token = client.cookies["csrftoken"].value
    accepted = client.post(url, {"name": "pool-b"}, content_type="application/json", HTTP_X_CSRFTOKEN=token)
    assert accepted.status_code == 201


def test_sign_out_ends_the_session(client, personas):
    client.force_login(personas.alice)
    client.post(reverse("accounts:logout"))
    assert client.get(reverse("workloads:list")).status_code == 302


def test_sign_in_page_sends_to_initialisation_while_no_root_exists(client, db):
    response = client.get(reverse("accounts:login"))
    assert response.status_code == 302
    assert response["Location"] == reverse("accounts:init")


def test_password_change_applies_the_byte_length_rule(client, personas):
    client.force_login(personas.alice)
    url = reverse("accounts:password_change")
    too_long = "😀" * 24
    response = client.post(url, {"old_password": PASSWORD, "new_password1": too_long, "new_password2": too_long})
    assert response.status_code == 200
    assert b"96 bytes long" in response.content
    good = "a new password"
    response = client.post(url, {"old_password": PASSWORD, "new_password1": good, "new_password2": good})
    assert response.status_code == 302
    personas.alice.refresh_from_db()
    assert personas.alice.check_password(good)


def test_root_grants_and_revokes_administrator_from_the_users_page(client, personas):
    client.force_login(personas.root)
    client.post(reverse("accounts:user_role", args=[personas.carol.pk]), {"admin": "1"})
    personas.carol.refresh_from_db()
    assert personas.carol.role == Role.ADMIN
    client.post(reverse("accounts:user_role", args=[personas.carol.pk]), {"admin": "0"})
    personas.carol.refresh_from_db()
    assert personas.carol.role == Role.USER


def test_root_cannot_demote_itself(client, personas):
    client.force_login(personas.root)
    response = client.put(
        reverse("api-user-role", args=[personas.root.pk]), {"admin": False}, content_type="application/json"
    )
    assert response.status_code == 400
    personas.root.refresh_from_db()
    assert personas.root.role == Role.ROOT


def test_administrator_creates_a_user_who_can_sign_in(client, personas):
    client.force_login(personas.admin)
    response = client.post(
        reverse("api-users"), {"username": "dave", "password": "dave's password"}, content_type="application/json"
    )
    assert response.status_code == 201
    assert response.json()["role"] == "user"
    assert sign_in(Client(), "dave", "dave's password").status_code == 302


@pytest.mark.parametrize("password", ["short", "😀" * 24])
def test_user_creation_refuses_passwords_outside_12_to_72_bytes(client, personas, password):
    client.force_login(personas.admin)
    response = client.post(
        reverse("api-users"), {"username": "dave", "password": password}, content_type="application/json"
    )
    assert response.status_code == 400
    assert "bytes long in UTF-8" in response.json()["detail"]
    assert not User.objects.filter(username="dave").exists()


def test_a_second_root_cannot_exist(personas):
    from django.db import IntegrityError, transaction

    with pytest.raises(IntegrityError), transaction.atomic():
        User.objects.create(username="root2", role=Role.ROOT)


def test_spraying_one_password_over_many_names_from_one_address_is_throttled(client, personas, settings):
    settings.SIGN_IN_ADDRESS_FAILURE_LIMIT = 20
    for n in range(30):
        response = sign_in(client, f"user-{n}", "Summer2026!")
        if response.status_code == 429:
            break
    assert n == 20  # the 21st name tried is refused without being checked
    assert b"under several names" in response.content
    # From that address even a right password waits; another address is not affected.
    assert sign_in(client, "bob", PASSWORD).status_code == 429
    elsewhere = Client(REMOTE_ADDR="10.9.8.7")
    assert sign_in(elsewhere, "bob", PASSWORD).status_code == 302
