"""Shared helpers for the agent tests: a temp home, writer processes, an agent subprocess, a fake site.

A module of its own (not conftest) so that tests can import it by a name unique in the suite.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from siteserver import SiteServer  # noqa: E402

from comminsight.formats import header  # noqa: E402
from comminsight.formats.archive import read_archive  # noqa: E402

COMMINSIGHT = Path(sys.executable).parent / "comminsight"


def fast_env(home: Path, **extra: str) -> dict[str, str]:
    """Environment for an agent subprocess with small intervals so tests finish quickly."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMINSIGHT_")}
    env.update(
        {
            "COMMINSIGHT_HOME": str(home),
            "COMMINSIGHT_AGENT_LISTEN": "127.0.0.1:0",
            "COMMINSIGHT_AGENT_POLL_INTERVAL": "0.05",
            "COMMINSIGHT_AGENT_CHECKPOINT_INTERVAL": "0.2",
            "COMMINSIGHT_ARCHIVE_INTERVAL": "0.5",
            "COMMINSIGHT_AGENT_ORPHAN_GRACE": "0.3",
            "COMMINSIGHT_AGENT_BACKOFF_INITIAL": "0.1",
            "COMMINSIGHT_AGENT_BACKOFF_MAX": "0.5",
            "COMMINSIGHT_AGENT_LIVE_INTERVAL": "0.5",
            "COMMINSIGHT_WORKLOAD_ID": "job-1",
            "COMMINSIGHT_COMMON_ARCHIVE_MOUNT_PATH": str(home.parent / "mount"),
            "NODE_IP": "10.0.0.7",
        }
    )
    env.update(extra)
    return env


class AgentProcess:
    def __init__(self, home: Path, env: dict[str, str]) -> None:
        self.home = home
        self.log_path = home.parent / f"agent-{time.time_ns()}.log"
        (home / "metadata" / "agent").mkdir(parents=True, exist_ok=True)
        marker = home / "metadata" / "agent" / "agent.json"
        marker.unlink(missing_ok=True)
        self.log = open(self.log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [str(COMMINSIGHT), "agent", "run"], env=env, stdout=self.log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if marker.exists():
                try:
                    info = json.loads(marker.read_text())
                    if info.get("pid") == self.proc.pid and info.get("listen"):
                        self.url = f"http://{info['listen']}"
                        return
                except ValueError:
                    pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent exited early:\n{self.output()}")
            time.sleep(0.05)
        raise RuntimeError(f"agent did not start:\n{self.output()}")

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=10)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int:
        if self.log.closed:
            return self.proc.returncode
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture
def home(tmp_path: Path) -> Path:
    h = tmp_path / "home"
    h.mkdir()
    return h


@pytest.fixture
def start_agent(home: Path) -> Iterator[Callable[..., AgentProcess]]:
    started: list[AgentProcess] = []

    def start(**extra: str) -> AgentProcess:
        agent = AgentProcess(home, fast_env(home, **extra))
        started.append(agent)
        return agent

    yield start
    for agent in started:
        agent.stop()


@pytest.fixture
def site() -> Iterator[SiteServer]:
    server = SiteServer()
    yield server
    server.close()


def start_writer(home: Path, rank: int, nranks: int, **options: object) -> subprocess.Popen:
    args = [
        sys.executable,
        str(HERE / "pywriter.py"),
        "--home",
        str(home),
        "--rank",
        str(rank),
        "--nranks",
        str(nranks),
    ]
    for key, value in options.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return subprocess.Popen(args)


def wait_for(predicate: Callable[[], object], timeout: float = 30.0, interval: float = 0.1) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


def archived_records(root: Path) -> np.ndarray:
    """(pid, record_seq) of every valid record in every archive under ``root``."""
    from comminsight.agent.segments import parse_header, records_from_bytes

    keys = []
    for path in sorted(root.rglob("*.tar.zst")):
        _, members = read_archive(path)
        for name, data in members:
            if name.startswith("segments/"):
                parse_header(data, Path(name))
                records, _, _ = records_from_bytes(memoryview(data)[header.constants()["CI_LOG_HEADER_SIZE"] :])
                keys.append(np.stack([records["pid"].astype(np.int64), records["record_seq"].astype(np.int64)], 1))
    return np.concatenate(keys) if keys else np.empty((0, 2), np.int64)
