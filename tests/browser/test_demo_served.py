"""The demo job on the site as `make run` starts it (`manage.py serve`: Daphne with WebSockets), from a new site's
first page: once on the embedded defaults (SQLite, tasks in-process) and once against PostgreSQL, Redis and a Celery
worker. The person initialises the site, runs the demo from the empty list, watches the open page turn Hung over
the socket, and reads the hang analysis naming the stuck rank."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
]

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "a demo password for root"
PLAN = {"steps": 14, "step_ms": 150.0, "straggler_from_step": 2, "hang_step": 10, "hang_s": 15.0,
        "agent_hang_floor_s": 2.0, "archive_interval_s": 2.0}  # fmt: skip


@dataclass(frozen=True)
class ServedSite:
    url: str
    data_dir: Path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


@pytest.fixture(params=["embedded", "services"])
def served_site(request, tmp_path, profiler_plugin) -> Iterator[ServedSite]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMMINSIGHT_", "DJANGO_", "DATABASE_", "REDIS_"))}
    env.update(
        COMMINSIGHT_SERVER_DATA_DIR=str(tmp_path / "data"),
        COMMINSIGHT_SERVER_LISTEN=f"127.0.0.1:{port}",
        COMMINSIGHT_DEMO_PLAN=json.dumps(PLAN),
        COMMINSIGHT_DISCOVERY_INTERVAL_S="5",
    )
    database = None
    if request.param == "services":
        if not (os.environ.get("DATABASE_URL", "").startswith("postgres") and os.environ.get("REDIS_URL")):
            pytest.skip("needs DATABASE_URL (PostgreSQL) and REDIS_URL")
        import psycopg

        server_url = os.environ["DATABASE_URL"].rsplit("/", 1)[0]
        database = f"demo_served_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(f"{server_url}/postgres", autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{database}"')
        # Its own database and task queue: nothing queued by another run of the site reaches this worker.
        env.update(DATABASE_URL=f"{server_url}/{database}", REDIS_URL=os.environ["REDIS_URL"], CELERY_QUEUE=database)
    processes = [
        subprocess.Popen(
            [sys.executable, "manage.py", "serve"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
    ]
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert processes[0].poll() is None, "manage.py serve exited"
            assert time.monotonic() < deadline, "manage.py serve did not start"
            time.sleep(0.5)
        if database:
            worker = [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "comminsight_site",
                "worker",
                "-Q",
                database,
                "-c",
                "2",
            ]
            processes.append(subprocess.Popen([*worker, "-l", "warning"], cwd=ROOT, env=env))
        yield ServedSite(url, tmp_path / "data")
    finally:
        for process in reversed(processes):
            _stop(process)
        if database:
            with psycopg.connect(f"{server_url}/postgres", autocommit=True) as admin:
                admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


def test_a_new_site_runs_the_demo_and_the_person_watches_it_hang_then_reads_why(
    served_site: ServedSite, page, artifacts, request
):
    kind = request.node.callspec.id
    page.goto(served_site.url + "/")
    page.fill("#id_token", (served_site.data_dir / "bootstrap-token").read_text().strip())
    page.fill("#id_password1", PASSWORD)
    page.fill("#id_password2", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url("**/accounts/login/")
    page.fill("#id_username", "root")
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url("**/workloads/")
    page.click("#run-demo")
    page.wait_for_url("**/workloads/*/")
    # The page is not reloaded: the status, counts and archives follow the server over the WebSocket.
    page.wait_for_function(
        "document.querySelector('#workload-status').textContent.trim() === 'Running'", timeout=120_000
    )
    page.wait_for_function("document.querySelector('#workload-status').textContent.trim() === 'Hung'", timeout=180_000)
    page.wait_for_function("!document.querySelector('#no-archives')", timeout=120_000)
    page.screenshot(path=artifacts / f"60-served-demo-hung-{kind}.png", full_page=True)
    # The analyses are queued when the launcher gives up on the hung job; their rows appear on the open page.
    hang_link = "#analysis a[href*='/analyses/']:has-text('Hang')"
    page.wait_for_selector(hang_link, timeout=240_000)
    page.click(hang_link)
    page.wait_for_function("document.body.innerText.includes('Verdict')", timeout=240_000)
    verdict = page.inner_text("main")
    assert "rank(s) 5" in verdict or "Look first at rank(s): 5" in verdict
    page.screenshot(path=artifacts / f"61-served-demo-verdict-{kind}.png", full_page=True)
    page.goto(served_site.url + "/workloads/")
    row = page.inner_text("#workloads-table")
    assert "Hung" in row
    assert "Finished" not in row
