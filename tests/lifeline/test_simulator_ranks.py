"""Simulator rank processes end with ``comminsight simulate run``, whether it is terminated or killed."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.lifeline.processes import kill_all, pids_with, wait_until

REPO = Path(__file__).resolve().parents[2]
RANKS = 4

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def plugin() -> Path:
    build = subprocess.run(["make", "-s", "-C", str(REPO / "native/profiler")], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    return REPO / "native/profiler/build/libnccl-profiler-comminsight.so"


def start_long_simulation(home: Path, plugin: Path) -> tuple[subprocess.Popen, set[int]]:
    """A run far longer than the test, its parent, and the pids of its rank processes once all are up."""
    parent = subprocess.Popen(
        [
            *(sys.executable, "-c", "from comminsight.cli import main; main()", "simulate", "run", "-o", str(home)),
            *("--plugin", str(plugin), "-n", str(RANKS), "--steps", "300", "--step-ms", "500", "--quiet"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a signal to the test's group never reaches it by accident
    )
    marker = str(home / "simulator")
    assert wait_until(lambda: len(pids_with(marker)) == RANKS, timeout=120), "the ranks never all started"
    return parent, pids_with(marker)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["terminated", "killed"])
def test_no_rank_survives_its_simulate_run(tmp_path, plugin, signum):
    parent, ranks = start_long_simulation(tmp_path / "home", plugin)
    try:
        parent.send_signal(signum)
        parent.wait(timeout=120)
        assert parent.returncode == -signum  # it ends by the signal it was sent, after its ranks
        assert wait_until(lambda: not pids_with(str(tmp_path / "home" / "simulator")), timeout=60), (
            f"rank processes still running: {sorted(pids_with(str(tmp_path / 'home' / 'simulator')))}"
        )
    finally:
        kill_all(ranks)
        if parent.poll() is None:
            parent.kill()
            parent.wait()
