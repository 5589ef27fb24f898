"""One liveness check for a pid, used by the lifeline and by the agent's orphan and writer checks."""

from __future__ import annotations

import os
import subprocess
import sys

from comminsight.lifeline import pid_alive


def test_a_running_process_is_alive_and_an_ended_one_is_not():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid no longer names a process (pids are not reused this fast)
    assert pid_alive(os.getpid())
    assert not pid_alive(child.pid)


def test_no_pid_is_never_alive():
    assert not pid_alive(0)
    assert not pid_alive(-1)


def test_an_injected_proc_answers_from_its_own_entries(tmp_path):
    (tmp_path / "4242").mkdir()
    assert pid_alive(4242, tmp_path)
    assert not pid_alive(os.getpid(), tmp_path)  # the real process table is not consulted
