"""Lifelines: every process the product starts ends when the process that started it ends.

Two halves, because a parent can end in two ways:

* **Terminated** (SIGTERM from ``timeout``, a CI runner, a supervisor; SIGINT; SIGHUP): the parent's
  :class:`ForwardSignals` passes the signal on to its children, waits for them (a grace, then
  SIGKILL), and ends itself by the same signal, so its own exit status still says what happened.
* **Dead** (SIGKILL, a crash, the OOM killer): nothing runs in the parent any more, so the child
  watches. The parent names itself in the child's environment (:func:`child_environment`); the
  child calls :func:`watch_parent` first thing. On Linux, when that pid is the child's real parent,
  ``prctl(PR_SET_PDEATHSIG)`` has the kernel signal the child the moment the parent thread dies; in
  every case a daemon thread also polls the named pid (``getppid()`` for the real parent, the pid
  itself for a process that started us through a double fork), which covers other systems, a
  parent that died before the prctl took effect, and detached starters.

A child that wants a clean stop (the node agent: final seal and upload) asks for SIGTERM; simulator
ranks and server workers take SIGTERM too (no handler: the default action ends them at once).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

ENV = "COMMINSIGHT_LIFELINE_PID"  # the pid whose end ends this process
PR_SET_PDEATHSIG = 1
POLL_S = 0.5
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PROC = Path("/proc")


def child_environment(env: Mapping[str, str] | None = None, parent_pid: int | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) naming ``parent_pid`` (default: this process) as lifeline."""
    out = dict(os.environ if env is None else env)
    out[ENV] = str(os.getpid() if parent_pid is None else parent_pid)
    return out


def pid_alive(pid: int, proc_root: Path = PROC) -> bool:
    """Whether process ``pid`` exists.

    ``proc_root`` other than /proc (tests) is read as a directory of pids; on the real /proc the kernel
    is asked (``kill(pid, 0)``), where a process of another user counts as alive.
    """
    if pid <= 0:
        return False
    if proc_root != PROC:
        return (proc_root / str(pid)).exists()
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _set_pdeathsig(signum: int) -> bool:
    """Ask the kernel to send ``signum`` when our parent dies (Linux only); False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _end_self(signum: int, grace_s: float) -> None:
    """Deliver ``signum`` to this process; if it is still alive after ``grace_s`` (a handler that lingers), exit."""
    os.kill(os.getpid(), signum)
    time.sleep(grace_s)
    os._exit(128 + signum)


def watch_parent(
    signum: int = signal.SIGTERM,
    *,
    parent_pid: int | None = None,
    grace_s: float = 60.0,
    poll_s: float = POLL_S,
) -> int | None:
    """End this process with ``signum`` when ``parent_pid`` (default: ``$COMMINSIGHT_LIFELINE_PID``) ends.

    Returns the pid watched, or None when there is none to watch (no variable: started by hand). The
    variable is removed from this process's environment, so our own children are not tied to our parent.
    A parent already gone ends this process within one poll.
    """
    if parent_pid is None:
        named = os.environ.pop(ENV, "")
        if not named.isdigit() or int(named) <= 1:
            return None
        parent_pid = int(named)
    real_parent = os.getppid() == parent_pid
    if real_parent:
        _set_pdeathsig(signum)

    def gone() -> bool:
        return os.getppid() != parent_pid if real_parent else not pid_alive(parent_pid)

    def watch() -> None:  # its first look also catches a parent that died before anything was armed
        while not gone():
            time.sleep(poll_s)
        _end_self(signum, grace_s)

    threading.Thread(target=watch, name="comminsight-lifeline", daemon=True).start()
    return parent_pid


class ForwardSignals:
    """While active, SIGTERM/SIGINT/SIGHUP to this process go to ``children()`` first, then end this process.

    ``children`` returns the current ``subprocess.Popen`` objects (the list may grow while active). After
    forwarding, the children get ``grace_s`` to end before SIGKILL; then the previous handler is put back
    and the signal delivered again, so this process ends as it would have without us (or runs the
    previous Python handler, e.g. KeyboardInterrupt for SIGINT). Only the main thread can install
    handlers: elsewhere this does nothing and the children rely on their own lifeline.
    """

    def __init__(self, children: Callable[[], Iterable[subprocess.Popen[Any]]], grace_s: float = 10.0) -> None:
        self.children = children
        self.grace_s = grace_s
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> ForwardSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in FORWARDED:
                if signal.getsignal(signum) is not signal.SIG_IGN:  # an ignored signal (nohup) stays ignored
                    self.previous[signum] = signal.signal(signum, self._forward)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous.clear()

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        children = [child for child in self.children() if child.poll() is None]
        for child in children:
            child.send_signal(signum)
        deadline = time.monotonic() + self.grace_s
        for child in children:
            try:
                child.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        previous = self.previous.get(signum, signal.SIG_DFL)
        self.__exit__()
        if callable(previous):
            previous(signum, frame)
        else:
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)
            os.kill(os.getpid(), signum)
