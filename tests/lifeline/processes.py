"""Finding and waiting for the processes a test started, by what their command line holds (Linux /proc)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path


def pids_with(marker: str) -> set[int]:
    """Live processes whose command line contains ``marker`` (zombies count as gone)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z" and int(entry.name) != os.getpid():
            found.add(int(entry.name))
    return found


def wait_until(predicate: Callable[[], object], timeout: float) -> bool:
    """Whether ``predicate`` became true within ``timeout`` seconds (generous: the machine may be busy)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return bool(predicate())


def kill_all(pids: set[int]) -> None:
    """Clean up after a failed test: SIGKILL each of ``pids`` still alive (only pids this test found)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, 9)
