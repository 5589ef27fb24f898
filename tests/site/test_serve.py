"""`manage.py serve` (what `make run` starts): a real Daphne on a fresh data directory."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from django.core.management.base import CommandError

from apps.accounts.management.commands.serve import daphne_endpoint

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("listen", "endpoint"),
    [
        ("127.0.0.1:8000", "tcp:port=8000:interface=127.0.0.1"),
        ("0.0.0.0:80", "tcp:port=80:interface=0.0.0.0"),
        ("[::1]:8080", r"tcp:port=8080:interface=\:\:1"),
    ],
)
def test_listen_addresses_become_daphne_endpoints(listen, endpoint):
    assert daphne_endpoint(listen) == endpoint


@pytest.mark.parametrize("listen", ["8000", "localhost", ":8000", "host:http", ""])
def test_malformed_listen_addresses_are_refused(listen):
    with pytest.raises(CommandError, match="HOST:PORT"):
        daphne_endpoint(listen)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_serve_on_a_bare_machine_starts_daphne_and_names_only_the_token_path(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE")}
    env.update(COMMINSIGHT_SERVER_DATA_DIR=str(tmp_path), COMMINSIGHT_SERVER_LISTEN=f"127.0.0.1:{port}")
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        server = subprocess.Popen([sys.executable, "manage.py", "serve"], cwd=ROOT, env=env, stdout=out, stderr=out)
        try:
            answered = None
            for _ in range(150):
                try:
                    answered = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
                    break
                except httpx.HTTPError:
                    time.sleep(0.2)
            assert answered is not None
            assert answered.json() == {"status": "ok"}
            home = httpx.get(f"http://127.0.0.1:{port}/")
            assert home.headers["location"] == "/init/"
        finally:
            server.terminate()
            server.wait(timeout=30)
    token = (tmp_path / "bootstrap-token").read_text().strip()
    output = log.read_text()
    assert str(tmp_path / "bootstrap-token") in output
    assert token not in output
    assert (tmp_path / "db.sqlite3").exists()


@pytest.mark.slow
@pytest.mark.parametrize(("setting", "logged"), [(None, True), ("1", True), ("0", False)])
def test_each_request_has_an_access_line_unless_the_access_log_is_off(tmp_path, setting, logged):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE")}
    env.update(COMMINSIGHT_SERVER_DATA_DIR=str(tmp_path), COMMINSIGHT_SERVER_LISTEN=f"127.0.0.1:{port}")
    env["LOG_LEVEL"] = "INFO"  # the site's default
    env.pop("COMMINSIGHT_SERVER_ACCESS_LOG", None)
    if setting is not None:
        env["COMMINSIGHT_SERVER_ACCESS_LOG"] = setting
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        server = subprocess.Popen([sys.executable, "manage.py", "serve"], cwd=ROOT, env=env, stdout=out, stderr=out)
        answered: int | None = None
        try:
            for _ in range(150):
                try:
                    answered = httpx.get(f"http://127.0.0.1:{port}/healthz?probe=access-log", timeout=1).status_code
                    break
                except httpx.HTTPError:
                    time.sleep(0.2)
        finally:
            server.terminate()
            server.wait(timeout=30)
    # The request must have been answered: a server that never came up writes no access line either.
    assert answered == 200, log.read_text()
    assert ('"GET /healthz?probe=access-log HTTP/1.1" 200' in log.read_text()) is logged


def children_of(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found.update(int(child) for child in (task / "children").read_text().split())
    return found


@pytest.mark.slow  # multi-process: starts three Python processes
def test_serve_with_two_workers_answers_from_both_and_stops_them_all(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE")}
    env.update(COMMINSIGHT_SERVER_DATA_DIR=str(tmp_path), COMMINSIGHT_SERVER_LISTEN=f"127.0.0.1:{port}")
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            [sys.executable, "manage.py", "serve", "--workers", "2"], cwd=ROOT, env=env, stdout=out, stderr=out
        )
        try:
            answers = []
            for _ in range(150):
                try:
                    # A fresh connection each time, so the kernel may hand it to either worker.
                    answers = [httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).json() for _ in range(6)]
                    break
                except httpx.HTTPError:
                    time.sleep(0.2)
            assert answers == [{"status": "ok"}] * 6
            workers = children_of(server.pid)
            assert len(workers) == 2
        finally:
            server.terminate()
            server.wait(timeout=60)
    assert server.returncode == 0
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers)


def test_serve_refuses_zero_workers():
    from django.core.management import call_command

    with pytest.raises(CommandError, match="at least 1"):
        call_command("serve", "--workers", "0", "--no-migrate")
