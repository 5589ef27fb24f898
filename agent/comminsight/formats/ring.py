"""Consumer side of the profiler's shared-memory ring (layout: native/profiler/include/comminsight_ring.h).

A ring file is ``CI_RING_HEADER_SIZE`` bytes of ``ci_ring_header`` followed by ``capacity`` records of
``CI_RECORD_SIZE`` bytes. One producer (the plugin's writer thread) writes a record into slot
``head & (capacity - 1)`` and then publishes ``head`` (release store); we, the single consumer, read
``head``, copy the committed records between our cursor and ``head`` out of the mapping with one
``np.frombuffer`` view per contiguous run, verify each record's magic and checksum, and later publish
``tail`` so the producer may reuse the slots.

Memory ordering: on x86-64 an aligned 8-byte load is atomic and loads are not reordered with other
loads (TSO), so reading ``head`` then the slots gives acquire semantics without a fence; the copy of
the slots completes before the tail store (a later store in program order). The agent supports
x86-64 hosts; on weakly ordered hosts the checksum still rejects a torn record.

The consumer keeps a private ``cursor`` and publishes ``tail`` only when told (``publish``): the agent
publishes after it has checkpointed what it consumed, so every record past the last checkpoint is
still in the ring after a crash (exactly-once across agent restarts). A ring whose writer died is
read the same way: whatever was committed is still there.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import overload

import numpy as np

from comminsight.formats import header


class RingError(ValueError):
    """A ring file that cannot be consumed; the message names the file and the reason."""


@dataclass(frozen=True)
class RingInfo:
    """Header fields that describe one writer incarnation."""

    path: Path
    capacity: int
    writer_pid: int
    writer_start_ns: int
    writer_closed: bool
    host: str


class Columns:
    """A batch in columnar form: one contiguous numpy array per record field, all of one length.

    Indexing by field name gives the column; indexing by a boolean mask gives the filtered batch
    (so code written for structured record arrays also accepts a Columns batch).
    """

    __slots__ = ("data", "n")

    def __init__(self, data: dict[str, np.ndarray], n: int) -> None:
        self.data = data
        self.n = n

    def __len__(self) -> int:
        return self.n

    @overload
    def __getitem__(self, key: str) -> np.ndarray: ...
    @overload
    def __getitem__(self, key: np.ndarray) -> Columns: ...
    def __getitem__(self, key: str | np.ndarray) -> np.ndarray | Columns:
        if isinstance(key, str):
            return self.data[key]
        return Columns({name: column[key] for name, column in self.data.items()}, int(np.count_nonzero(key)))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.data)


@dataclass
class RingBatch:
    """Committed records read in one call, already verified and in columnar form.

    ``records`` holds one row per valid record; ``first_index``/``next_index`` the ring indices
    read; ``corrupt`` how many slots failed magic/checksum verification and were left out.
    """

    records: Columns
    first_index: int
    next_index: int
    corrupt: int


_FNV_OFFSET = np.uint32(2166136261)
_FNV_PRIME = np.uint32(16777619)


def _checksum_pairs(pairs_t: np.ndarray, out: np.ndarray) -> np.ndarray:
    """FNV-1a checksum per record from a (32, n) matrix of the records' u64 word pairs, transposed.

    Transposing 64-bit pairs moves half as many elements as transposing 32-bit words (the transpose
    is the costliest step); each u32 word is then read as the low or high half of its pair.
    """
    n = pairs_t.shape[1]
    words = pairs_t.view(np.uint32).reshape(pairs_t.shape[0], n, 2)
    out.fill(_FNV_OFFSET)
    with np.errstate(over="ignore"):
        for pair in range(words.shape[0]):
            for half in (0, 1):
                if (pair, half) != (0, 1):  # word 1 is the checksum field, taken as zero: no xor
                    np.bitwise_xor(out, words[pair, :, half], out=out)
                np.multiply(out, _FNV_PRIME, out=out)
    return out


class RingReader:
    """One mapped ring file, validated on open. Not thread-safe: one consumer per ring."""

    CHUNK = 8192  # records per cache-sized step of ``read`` (2 MiB of slots)

    def __init__(self, path: Path | str, cursor: int | None = None) -> None:
        self.path = Path(path)
        consts = header.constants()
        hdr_dtype = header.struct_dtype("ci_ring_header")
        self._rec_dtype = header.record_dtype()
        try:
            fd = os.open(self.path, os.O_RDWR)
        except OSError as exc:
            raise RingError(f"{self.path}: cannot open ring ({exc.strerror})") from exc
        try:
            size = os.fstat(fd).st_size
            if size < consts["CI_RING_HEADER_SIZE"]:
                raise RingError(
                    f"{self.path}: truncated ring ({size} bytes, header needs {consts['CI_RING_HEADER_SIZE']})"
                )
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        hdr = np.frombuffer(self._map, dtype=hdr_dtype, count=1).copy()[0]  # no view may outlive a close
        problem = None
        if int(hdr["magic"]) != consts["CI_RING_MAGIC"]:
            problem = f"bad magic 0x{int(hdr['magic']):016x}"
        elif int(hdr["version"]) != consts["CI_FORMAT_VERSION"]:
            problem = f"unsupported version {int(hdr['version'])} (reader knows {consts['CI_FORMAT_VERSION']})"
        elif int(hdr["header_size"]) != consts["CI_RING_HEADER_SIZE"]:
            problem = f"header_size {int(hdr['header_size'])} != {consts['CI_RING_HEADER_SIZE']}"
        elif int(hdr["record_size"]) != consts["CI_RECORD_SIZE"]:
            problem = f"record_size {int(hdr['record_size'])} != {consts['CI_RECORD_SIZE']}"
        else:
            capacity = int(hdr["capacity"])
            if capacity <= 0 or capacity & (capacity - 1):
                problem = f"capacity {capacity} is not a power of two"
            elif size < consts["CI_RING_HEADER_SIZE"] + capacity * consts["CI_RECORD_SIZE"]:
                problem = f"truncated ring ({size} bytes for {capacity} records)"
        if problem:
            self._map.close()
            raise RingError(f"{self.path}: {problem}")
        self.capacity = int(hdr["capacity"])
        self._mask = self.capacity - 1
        fields = hdr_dtype.fields
        assert fields is not None  # structured dtypes always have fields and names
        assert self._rec_dtype.names is not None
        self._head_off = fields["head"][1]
        self._tail_off = fields["tail"][1]
        self._seal_request_off = fields["seal_request"][1]
        self._seal_done_off = fields["seal_done"][1]
        self._inflight_report_off = fields["inflight_report_ns"][1]
        self._hdr_dtype = hdr_dtype
        self._slots = np.frombuffer(
            self._map, dtype=self._rec_dtype, count=self.capacity, offset=consts["CI_RING_HEADER_SIZE"]
        )
        self._u64 = np.frombuffer(self._map, dtype="<u8", count=consts["CI_RING_HEADER_SIZE"] // 8)
        self._pairs = self._slots.view(np.uint64).reshape(self.capacity, -1)
        self._magic = np.uint32(consts["CI_RECORD_MAGIC"])
        self._names = tuple(
            n for n in self._rec_dtype.names if not n.startswith("_") and n not in ("magic", "checksum")
        )
        self.info = RingInfo(
            path=self.path,
            capacity=self.capacity,
            writer_pid=int(hdr["writer_pid"]),
            writer_start_ns=int(hdr["writer_start_ns"]),
            writer_closed=bool(hdr["writer_closed"]),
            host=bytes(hdr["host"]).split(b"\0", 1)[0].decode("utf-8", "replace"),
        )
        tail = self.tail
        self.cursor = tail
        if cursor is not None and tail <= cursor <= self.head:
            # A checkpointed cursor ahead of the published tail: the agent consumed those records
            # and saved them, then died before publishing the tail.
            self.cursor = cursor

    # Header fields are re-read on each access: the producer changes them.
    @property
    def head(self) -> int:
        return int(self._u64[self._head_off // 8])

    @property
    def tail(self) -> int:
        return int(self._u64[self._tail_off // 8])

    def counters(self) -> dict[str, int]:
        """Live producer counters: dropped, lost, head, tail, writer_closed."""
        hdr = np.frombuffer(self._map, dtype=self._hdr_dtype, count=1)[0]
        return {
            "dropped": int(hdr["dropped"]),
            "lost": int(hdr["lost"]),
            "head": int(hdr["head"]),
            "tail": int(hdr["tail"]),
            "writer_closed": int(hdr["writer_closed"]),
        }

    @property
    def pending(self) -> int:
        """Committed records not yet read."""
        return max(0, self.head - self.cursor)

    def read(self, max_records: int) -> RingBatch:
        """Copy up to ``max_records`` committed records past the cursor into columns; advance the cursor.

        Work proceeds in cache-sized chunks: copy a chunk of slots out of the mapping (one memcpy),
        transpose it to word rows for the vectorised checksum, and scatter its fields into the
        output columns while it is still in cache. Raises RingError if the indices are impossible
        (head behind the cursor, or more committed records than the ring holds).
        """
        head = self.head
        start = self.cursor
        committed = head - start
        if committed < 0 or committed > self.capacity:
            raise RingError(f"{self.path}: impossible indices (head {head}, cursor {start}, capacity {self.capacity})")
        n = min(committed, max_records)
        out = {name: np.empty(n, self._rec_dtype[name]) for name in self._names}
        ok = np.empty(n, dtype=bool)
        pairs_per_record = self._rec_dtype.itemsize // 8
        chunk = self.CHUNK
        buf = np.empty((min(chunk, max(n, 1)), pairs_per_record), dtype=np.uint64)
        pairs_t = np.empty((pairs_per_record, buf.shape[0]), dtype=np.uint64)
        sums = np.empty(buf.shape[0], dtype=np.uint32)
        done = 0
        while done < n:
            slot = (start + done) & self._mask
            m = min(chunk, n - done, self.capacity - slot)  # a chunk never wraps
            np.copyto(buf[:m], self._pairs[slot : slot + m])
            np.copyto(pairs_t[:, :m], buf[:m].T)
            h = _checksum_pairs(pairs_t[:, :m], sums[:m])
            first = pairs_t[0, :m]  # magic in the low half, checksum in the high half (little-endian)
            ok[done : done + m] = ((first & 0xFFFFFFFF) == self._magic) & ((first >> np.uint64(32)) == h)
            view = buf[:m].view(self._rec_dtype).reshape(m)
            for name in self._names:
                out[name][done : done + m] = view[name]
            done += m
        batch = Columns(out, n)
        corrupt = int(n - np.count_nonzero(ok))
        if corrupt:
            batch = batch[ok]
        self.cursor = start + n
        return RingBatch(batch, start, start + n, corrupt)

    def publish(self, tail: int | None = None) -> None:
        """Publish ``tail`` (default: the cursor) so the producer may reuse the slots read."""
        value = self.cursor if tail is None else tail
        if self.tail <= value <= self.head:
            self._u64[self._tail_off // 8] = value

    # ---- requests to the writer (consumer-owned fields next to tail; see comminsight_ring.h) ----
    def request_seal(self) -> int:
        """Ask the writer to seal its open raw-log segment; returns the request number to wait for."""
        value = int(self._u64[self._seal_request_off // 8]) + 1
        self._u64[self._seal_request_off // 8] = value
        return value

    @property
    def seal_done(self) -> int:
        """The last seal request the writer honoured."""
        return int(self._u64[self._seal_done_off // 8])

    def set_inflight_report(self, seconds: float) -> None:
        """Have the writer put ops in flight longer than ``seconds`` into the ring (0: off)."""
        value = max(0, int(seconds * 1e9))
        if int(self._u64[self._inflight_report_off // 8]) != value:
            self._u64[self._inflight_report_off // 8] = value

    def close(self) -> None:
        try:
            self._slots = None  # type: ignore[assignment]
            self._pairs = None  # type: ignore[assignment]
            self._u64 = None  # type: ignore[assignment]
            self._map.close()
        except (BufferError, ValueError):
            pass  # a view still alive elsewhere; the mapping goes with the process


def columns(records: np.ndarray | Columns, names: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
    """Columnar form of a record batch: one contiguous numpy array per field (strings stay fixed-width bytes)."""
    if isinstance(records, Columns):
        return records.data if names is None else {name: records.data[name] for name in names}
    names = names or tuple(
        n for n in records.dtype.names or () if not n.startswith("_") and n not in ("magic", "checksum")
    )
    return {name: np.ascontiguousarray(records[name]) for name in names}


def create_ring(path: Path | str, capacity: int, *, pid: int = 0, start_ns: int = 0, host: str = "") -> None:
    """Create an empty ring file as the profiler would (tests, tools, benchmarks)."""
    consts = header.constants()
    hdr = np.zeros(1, dtype=header.struct_dtype("ci_ring_header"))
    hdr["magic"] = consts["CI_RING_MAGIC"]
    hdr["version"] = consts["CI_FORMAT_VERSION"]
    hdr["header_size"] = consts["CI_RING_HEADER_SIZE"]
    hdr["record_size"] = consts["CI_RECORD_SIZE"]
    hdr["capacity"] = capacity
    hdr["writer_pid"] = pid
    hdr["writer_start_ns"] = start_ns
    hdr["host"] = host.encode()[:63]
    with open(path, "wb") as handle:
        handle.write(hdr.tobytes())
        handle.truncate(consts["CI_RING_HEADER_SIZE"] + capacity * consts["CI_RECORD_SIZE"])


class RingWriter:
    """A Python producer faithful to the header's protocol (tests and benchmarks; the plugin is the real one)."""

    def __init__(self, path: Path | str) -> None:
        consts = header.constants()
        self._fd = os.open(path, os.O_RDWR)
        size = os.fstat(self._fd).st_size
        self._map = mmap.mmap(self._fd, size)
        hdr_dtype = header.struct_dtype("ci_ring_header")
        self._hdr = np.frombuffer(self._map, dtype=hdr_dtype, count=1)
        self.capacity = int(self._hdr["capacity"][0])
        self._slots = np.frombuffer(
            self._map, dtype=header.record_dtype(), count=self.capacity, offset=consts["CI_RING_HEADER_SIZE"]
        )

    def write(self, records: np.ndarray) -> int:
        """Write as many of ``records`` as fit (already sealed), publish head; count the rest as dropped."""
        head = int(self._hdr["head"][0])
        free = self.capacity - (head - int(self._hdr["tail"][0]))
        n = min(free, len(records))
        for offset in range(n):  # slot-by-slot keeps the wrap simple; tests write small batches
            self._slots[(head + offset) & (self.capacity - 1)] = records[offset]
        self._hdr["head"] = head + n  # publish after the slots are written
        if n < len(records):
            self._hdr["dropped"] = int(self._hdr["dropped"][0]) + len(records) - n
        return n

    def write_fast(self, records: np.ndarray) -> int:
        """Vectorised write of up to the free space (benchmarks)."""
        head = int(self._hdr["head"][0])
        free = self.capacity - (head - int(self._hdr["tail"][0]))
        n = min(free, len(records))
        first = head & (self.capacity - 1)
        run = min(n, self.capacity - first)
        self._slots[first : first + run] = records[:run]
        if n > run:
            self._slots[: n - run] = records[run:n]
        self._hdr["head"] = head + n
        return n

    def close(self, clean: bool = True) -> None:
        if clean:
            self._hdr["writer_closed"] = 1
        self._hdr = None  # type: ignore[assignment]
        self._slots = None  # type: ignore[assignment]
        self._map.close()
        os.close(self._fd)
