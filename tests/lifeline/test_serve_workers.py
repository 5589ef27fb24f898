"""``manage.py serve --workers N``: the worker processes end with their parent, terminated or killed."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.lifeline.processes import kill_all, wait_until

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children_of(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found.update(int(child) for child in (task / "children").read_text().split())
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["terminated", "killed"])
def test_no_server_worker_survives_its_parent(tmp_path, signum):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE")}
    env.update(COMMINSIGHT_SERVER_DATA_DIR=str(tmp_path), COMMINSIGHT_SERVER_LISTEN=f"127.0.0.1:{port}")
    server = subprocess.Popen(
        [sys.executable, "manage.py", "serve", "--workers", "2"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    workers: set[int] = set()
    try:

        def answering() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(answering, timeout=120), "the server never answered"
        assert wait_until(lambda: len(children_of(server.pid)) == 2, timeout=60)
        workers = children_of(server.pid)
        server.send_signal(signum)
        server.wait(timeout=120)
        assert wait_until(lambda: not any(alive(pid) for pid in workers), timeout=60), (
            f"workers still running: {sorted(pid for pid in workers if alive(pid))}"
        )
    finally:
        kill_all(workers)
        if server.poll() is None:
            server.kill()
            server.wait()
