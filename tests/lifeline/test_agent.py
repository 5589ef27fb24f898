"""The node agent stops cleanly (final seal) once the process that started it has ended, however it ended.

Two starters: a parent that spawned it (the site's demo; the kernel's parent-death signal and the
``getppid`` poll both apply) and a detached starter (the profiler's autostart forks twice, so the
agent only knows the starter's pid from ``COMMINSIGHT_LIFELINE_PID`` and polls it).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.agent.agentkit import COMMINSIGHT, fast_env
from tests.lifeline.processes import kill_all, pids_with, wait_until

pytestmark = pytest.mark.slow


def agent_log(home: Path) -> str:
    path = home / "logs" / "agent.log"
    return path.read_text() if path.exists() else ""


def started(home: Path) -> bool:
    return "agent started" in agent_log(home) or (home / "metadata" / "agent" / "agent.json").exists()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["terminated", "killed"])
def test_an_agent_stops_cleanly_when_the_process_that_spawned_it_ends(tmp_path, signum):
    home = tmp_path / "home"
    home.mkdir()
    spawn = (
        "import subprocess, sys\n"
        "from comminsight import lifeline\n"
        f"agent = subprocess.Popen([{str(COMMINSIGHT)!r}, 'agent', 'run'], env=lifeline.child_environment(),"
        " stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "agent.wait()\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", spawn], env=fast_env(home), start_new_session=True)
    agents: set[int] = set()
    try:
        assert wait_until(lambda: started(home), timeout=60), agent_log(home)
        agents = pids_with(f"{COMMINSIGHT} agent run") & children(parent.pid)
        assert len(agents) == 1
        parent.send_signal(signum)
        parent.wait(timeout=60)
        assert wait_until(lambda: not (pids_with(f"{COMMINSIGHT} agent run") & agents), timeout=90), agent_log(home)
        assert "agent stopped cleanly" in agent_log(home)
    finally:
        kill_all(agents)
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_an_autostarted_agent_stops_cleanly_when_its_detached_starter_is_killed(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    starter = subprocess.Popen(["sleep", "600"])  # stands for the training process of local rank 0
    agent = subprocess.Popen(
        [str(COMMINSIGHT), "agent", "run"],
        env={**fast_env(home), "COMMINSIGHT_LIFELINE_PID": str(starter.pid)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert wait_until(lambda: started(home), timeout=60), agent_log(home)
        starter.kill()
        starter.wait()
        assert agent.wait(timeout=90) == 0
        assert "agent stopped cleanly" in agent_log(home)
    finally:
        for process in (agent, starter):
            if process.poll() is None:
                process.kill()
                process.wait()


def children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found.update(int(child) for child in (task / "children").read_text().split())
    return found
