"""Fixtures for the profiler tests: the built .so, a temporary COMMINSIGHT_HOME, and the cffi driver."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LIBRARY = REPO / "native/profiler/build/libnccl-profiler-comminsight.so"
DRIVER = Path(__file__).resolve().parent / "driver.py"


@pytest.fixture(scope="session")
def library() -> Path:
    """The regular (non-sanitized) plugin, built once per session if needed."""
    subprocess.run(["make", "-s", "-C", str(REPO / "native/profiler")], check=True, capture_output=True)
    return LIBRARY


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """An empty COMMINSIGHT_HOME."""
    path = tmp_path / "home"
    path.mkdir()
    return path


def profiler_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment of a process that loads the plugin: our home, no agent autostart, nothing inherited."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMINSIGHT_")}
    env.update(COMMINSIGHT_HOME=str(home), COMMINSIGHT_AGENT_AUTOSTART="0")
    env.update(extra)
    return env


@pytest.fixture
def env_for() -> Callable[..., dict[str, str]]:
    """``profiler_env`` as a fixture, for tests that build their own environment."""
    return profiler_env


@pytest.fixture
def driver_path() -> Path:
    """The cffi driver script (run as a subprocess)."""
    return DRIVER


@pytest.fixture
def drive(library: Path, home: Path) -> Callable[..., tuple[dict, str]]:
    """Runs one driver scenario in a fresh process; returns (its JSON result, its stderr)."""

    def run(scenario: str, *args: str, env: dict[str, str] | None = None, timeout: float = 60) -> tuple[dict, str]:
        proc = subprocess.run(
            [sys.executable, str(DRIVER), str(library), scenario, *args],
            env=env or profiler_env(home),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr

    return run
