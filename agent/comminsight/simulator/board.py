"""The arrival board: a small file-backed shared-memory table the rank processes coordinate through.

One int64 array mapped by every process (``numpy.memmap`` over a file, MAP_SHARED):

    [0]                       abort flag (the parent sets it; every wait checks it)
    [1 .. 8)                  reserved
    status[nranks]            per-rank RankStatus
    steps_done[nranks]        steps finished per rank (progress display)
    heartbeat_ns[nranks]      last time a rank made progress (stall detection)
    arrivals[total_slots]     per rendezvous member: GPU arrival time in ns, 0 = not arrived

Aligned 8-byte stores and loads are atomic on the hosts we run on, and every value has a single
writer, so no lock is needed: a waiting rank polls its rendezvous until every member's slot is
non-zero. A file (rather than POSIX shm) leaves nothing behind in /dev/shm when a rank is killed.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

# Rendezvous waits: a waiting rank notices the last arrival at most this late. The modelled GPU end
# (last arrival + transfer) is exact either way, but the waiter's host resumes only once it noticed:
# a longer back-off delays every rank that waited, so a straggler slowed its peers by more than its
# own lateness (waiters then arrive late in turn and the delay ping-pongs). Transfers are 0.1-1 ms,
# so the cap stays below that. Other waits (start-up, a hung rank) keep the cheaper 2 ms.
RENDEZVOUS_POLL_S = 2.5e-4

_HEADER_WORDS = 8


class RankStatus(enum.IntEnum):
    """What a rank process is doing, as the parent sees it."""

    STARTING = 0
    READY = 1
    RUNNING = 2
    HUNG = 3
    DONE = 4
    ABORTED = 5
    CRASHED = 6
    FAILED = 7


class Aborted(Exception):
    """The parent ended the run (hang or crash elsewhere) while this rank was waiting."""


class Board:
    """The shared table (see the module docstring)."""

    def __init__(self, path: Path, nranks: int, total_slots: int, create: bool = False) -> None:
        words = _HEADER_WORDS + 3 * nranks + total_slots
        if create:
            with open(path, "wb") as handle:
                handle.truncate(words * 8)
        self.path = path
        self.nranks = nranks
        self.array = np.memmap(path, dtype=np.int64, mode="r+", shape=(words,))
        self.status = self.array[_HEADER_WORDS : _HEADER_WORDS + nranks]
        self.steps_done = self.array[_HEADER_WORDS + nranks : _HEADER_WORDS + 2 * nranks]
        self.heartbeat_ns = self.array[_HEADER_WORDS + 2 * nranks : _HEADER_WORDS + 3 * nranks]
        self.arrivals = self.array[_HEADER_WORDS + 3 * nranks :]

    @property
    def aborted(self) -> bool:
        """True once the parent asked every rank to stop."""
        return bool(self.array[0])

    def abort(self) -> None:
        """Ask every rank to stop waiting and finalize."""
        self.array[0] = 1

    def beat(self, rank: int) -> None:
        """Record that ``rank`` made progress now."""
        self.heartbeat_ns[rank] = time.time_ns()

    def set_status(self, rank: int, status: RankStatus) -> None:
        """Publish ``rank``'s status."""
        self.status[rank] = int(status)
        self.beat(rank)

    def wait(self, ready: Callable[[], bool], poll_s: float = 5e-5, max_poll_s: float = 0.002) -> None:
        """Poll ``ready`` with a growing back-off (to ``max_poll_s``) until it is true; raise Aborted on abort."""
        while not ready():
            if self.aborted:
                raise Aborted
            time.sleep(poll_s)
            poll_s = min(poll_s * 2, max(max_poll_s, poll_s))

    def close(self) -> None:
        """Flush and unmap."""
        self.array.flush()
        del self.status, self.steps_done, self.heartbeat_ns, self.arrivals
        self.array._mmap.close()  # type: ignore[attr-defined]
