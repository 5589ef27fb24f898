"""First-run initialisation: the token file, the page, single use, byte-length password rules."""

from __future__ import annotations

import logging
import stat
import threading

import pytest
from django.core.management import call_command
from django.db import connection
from django.urls import reverse

from apps.accounts import services
from apps.accounts.models import Role, User

GOOD_PASSWORD = "twelve chars"  # 12 ASCII bytes


def read_token(data_dir) -> str:
    return (data_dir / "bootstrap-token").read_text().strip()


def initialise(client, token: str, password: str = GOOD_PASSWORD, password2: str | None = None):
    return client.post(
        reverse("accounts:init"),
        {"token": token, "username": "root", "password1": password, "password2": password2 or password},
    )


@pytest.fixture
def issued(db, data_dir) -> str:
    services.bootstrap_ensure()
    return read_token(data_dir)


def test_token_file_is_private_to_the_server_user(issued, data_dir):
    mode = stat.S_IMODE((data_dir / "bootstrap-token").stat().st_mode)
    assert mode == 0o600


def test_serve_prints_the_token_path_but_never_the_token(db, data_dir, capsys, caplog):
    caplog.set_level(logging.DEBUG)
    call_command("serve", "--prepare-only", "--no-migrate")
    token = read_token(data_dir)
    out = capsys.readouterr()
    assert str(data_dir / "bootstrap-token") in out.out
    assert token not in out.out + out.err
    assert token not in caplog.text


def test_restart_keeps_the_token_an_operator_already_copied(issued, data_dir):
    services.bootstrap_ensure()
    assert read_token(data_dir) == issued


def test_initialisation_with_the_token_creates_root_and_deletes_the_file(client, issued, data_dir):
    response = initialise(client, issued)
    assert response.status_code == 302
    root = User.objects.get(role=Role.ROOT)
    assert root.username == "root"
    assert root.password.startswith("argon2")
    assert not (data_dir / "bootstrap-token").exists()


def test_the_initialisation_page_answers_404_once_root_exists(client, issued):
    initialise(client, issued)
    assert client.get(reverse("accounts:init")).status_code == 404
    assert initialise(client, issued).status_code == 404


def test_replayed_token_is_rejected_with_a_clear_error(issued, db):
    services.bootstrap_initialise(token=issued, username="root", password=GOOD_PASSWORD)
    with pytest.raises(services.BootstrapError, match="already initialised"):
        services.bootstrap_initialise(token=issued, username="root2", password=GOOD_PASSWORD)
    assert User.objects.count() == 1


def test_wrong_token_changes_nothing_and_says_so(client, issued, data_dir):
    response = initialise(client, "not-the-token")
    assert response.status_code == 400
    assert b"not the current bootstrap token" in response.content
    assert not User.objects.exists()
    assert read_token(data_dir) == issued


def test_wrong_tokens_are_throttled_even_before_the_right_one(client, issued, settings):
    for _ in range(settings.BOOTSTRAP_FAILURE_LIMIT):
        assert initialise(client, "guess").status_code == 400
    response = initialise(client, issued)
    assert response.status_code == 429
    assert not User.objects.exists()


@pytest.mark.parametrize(
    ("password", "accepted"),
    [
        ("a" * 11, False),
        ("a" * 12, True),
        ("a" * 72, True),
        ("a" * 73, False),
        ("é" * 36, True),  # 72 bytes
        ("é" * 37, False),  # 74 bytes, only 37 characters
        ("😀" * 24, False),  # 24 characters, 96 bytes
        ("😀" * 3, True),  # 3 characters, 12 bytes
    ],
)
def test_root_password_length_is_counted_in_utf8_bytes(client, issued, password, accepted):
    response = initialise(client, issued, password)
    assert User.objects.filter(role=Role.ROOT).exists() is accepted
    if not accepted:
        assert response.status_code == 400
        assert b"bytes long in UTF-8" in response.content


def test_mismatched_passwords_are_refused(client, issued):
    response = initialise(client, issued, GOOD_PASSWORD, GOOD_PASSWORD + "x")
    assert response.status_code == 400
    assert not User.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_two_concurrent_initialisations_create_exactly_one_root(data_dir):
    services.bootstrap_ensure()
    token = read_token(data_dir)
    barrier = threading.Barrier(2)
    outcomes: list[str] = []

    def attempt(name: str) -> None:
        barrier.wait()
        try:
            services.bootstrap_initialise(token=token, username=name, password=GOOD_PASSWORD)
            outcomes.append("ok")
        except services.BootstrapError as exc:
            outcomes.append(str(exc))
        finally:
            connection.close()

    threads = [threading.Thread(target=attempt, args=(f"root{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes.count("ok") == 1
    [refusal] = [o for o in outcomes if o != "ok"]
    # PostgreSQL makes the second wait and then see root; SQLite refuses it while the first holds the lock.
    assert "already initialised" in refusal or "in progress" in refusal
    assert User.objects.filter(role=Role.ROOT).count() == 1
    assert not (data_dir / "bootstrap-token").exists()


def test_bootstrap_status_and_reissue_commands_never_print_the_token(issued, data_dir, capsys):
    call_command("bootstrap", "status")
    assert "waiting for initialisation" in capsys.readouterr().out
    call_command("bootstrap", "reissue")
    out = capsys.readouterr().out
    new_token = read_token(data_dir)
    assert new_token != issued
    assert new_token not in out
    assert str(data_dir / "bootstrap-token") in out
    with pytest.raises(services.BootstrapError):
        services.bootstrap_initialise(token=issued, username="root", password=GOOD_PASSWORD)


def test_reissue_is_refused_once_root_exists(issued):
    from django.core.management.base import CommandError

    services.bootstrap_initialise(token=issued, username="root", password=GOOD_PASSWORD)
    with pytest.raises(CommandError, match="already initialised"):
        call_command("bootstrap", "reissue")
