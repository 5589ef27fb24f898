"""Single instance per home: the lock file, and the descriptor the profiler's autostart hands over."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from comminsight.agent.daemon import AlreadyRunning, InstanceLock


def test_second_lock_on_the_same_home_is_refused_with_the_owner_pid(tmp_path: Path) -> None:
    first = InstanceLock(tmp_path / "agent.lock")
    first.acquire()
    try:
        with pytest.raises(AlreadyRunning, match=f"pid {os.getpid()}"):
            InstanceLock(tmp_path / "agent.lock").acquire()
    finally:
        first.release()
    again = InstanceLock(tmp_path / "agent.lock")
    again.acquire()  # free once released
    again.release()


def test_the_locked_descriptor_from_the_profiler_is_adopted(tmp_path: Path) -> None:
    lock = tmp_path / "agent.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what autostart.c does before exec
    adopted = InstanceLock(lock, inherited_fd=str(fd))
    adopted.acquire()
    assert adopted.fd == fd
    assert lock.read_text().strip() == str(os.getpid())
    adopted.release()


def test_an_inherited_descriptor_of_another_file_is_not_trusted(tmp_path: Path) -> None:
    other = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT, 0o644)
    lock = InstanceLock(tmp_path / "agent.lock", inherited_fd=str(other))
    lock.acquire()
    assert lock.fd != other
    lock.release()
    os.close(other)
