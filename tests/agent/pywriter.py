"""A Python stand-in for the profiler's writer thread, faithful to comminsight_ring.h (tests only).

Importable helpers build sealed records, rings and raw-log segments; run as a script it is one
"rank": it emits ``--ops`` collectives on one communicator into its ring (dropping and counting when
full, as the plugin does) and its raw-log segments (rotated every ``--segment-records``), then
closes cleanly — unless killed. Hang mode: before op ``--hang-at`` it either stops (``--hang-role
never``: never enters) or writes a TIMEOUT snapshot and waits (``--hang-role inside``).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np

from comminsight.formats import header
from comminsight.formats.ring import RingWriter, create_ring

C = header.constants()


def make_records(
    n: int,
    *,
    comm_hash: int = 0xABCDEF0123456789,
    rank: int = 0,
    nranks: int = 1,
    pid: int = 1,
    first_seq: int = 0,
    first_record_seq: int = 0,
    func: str = "AllReduce",
    state: int | None = None,
    nbytes: int = 1 << 20,
    start_ns: int | None = None,
    comm_name: str = "dp",
) -> np.ndarray:
    """``n`` sealed records of consecutive seq on one communicator and rank."""
    records = np.zeros(n, dtype=header.record_dtype())
    t0 = start_ns or time.time_ns()
    idx = np.arange(n, dtype=np.uint64)
    records["kind"] = C["CI_KIND_COLL"]
    records["state"] = C["CI_STATE_COMPLETED"] if state is None else state
    records["flags"] = C["CI_FLAG_GPU_TIMES"]
    records["rank"] = rank
    records["nranks"] = nranks
    records["nnodes"] = 1
    records["peer"] = -1
    records["pid"] = pid
    records["cuda_device"] = rank
    records["comm_hash"] = comm_hash
    records["seq"] = first_seq + idx
    records["count"] = nbytes // 4
    records["bytes"] = nbytes
    records["enqueue_start_ns"] = t0 + idx * 1000
    records["enqueue_end_ns"] = t0 + idx * 1000 + 100
    records["gpu_start_ns"] = t0 + idx * 1000 + 200
    records["gpu_end_ns"] = t0 + idx * 1000 + 700
    records["complete_ns"] = t0 + idx * 1000 + 800 if (state in (None, C["CI_STATE_COMPLETED"])) else 0
    records["record_seq"] = first_record_seq + idx
    records["func"] = func.encode()
    records["dtype"] = b"ncclFloat32"
    records["algo"] = b"Ring"
    records["proto"] = b"Simple"
    records["comm_name"] = comm_name.encode()
    header.seal_records(records)
    return records


def segment_header(
    *,
    pid: int,
    index: int = 0,
    global_rank: int = 0,
    world_size: int = 1,
    host: str = "",
    workload: str = "",
    start_ns: int = 0,
) -> bytes:
    hdr = np.zeros(1, dtype=header.struct_dtype("ci_log_header"))
    hdr["magic"] = C["CI_LOG_MAGIC"]
    hdr["version"] = C["CI_FORMAT_VERSION"]
    hdr["header_size"] = C["CI_LOG_HEADER_SIZE"]
    hdr["record_size"] = C["CI_RECORD_SIZE"]
    hdr["pid"] = pid
    hdr["start_ns"] = start_ns or time.time_ns()
    hdr["segment_index"] = index
    hdr["local_rank"] = global_rank
    hdr["global_rank"] = global_rank
    hdr["world_size"] = world_size
    hdr["host"] = (host or socket.gethostname()).encode()[:63]
    hdr["workload_id"] = workload.encode()[:63]
    return hdr.tobytes()


def write_segment(
    logs_dir: Path,
    records: np.ndarray,
    *,
    pid: int,
    index: int = 0,
    global_rank: int = 0,
    sealed: bool = True,
    name: str | None = None,
) -> Path:
    logs_dir.mkdir(parents=True, exist_ok=True)
    path = logs_dir / (name or f"testhost-{pid}-1-{index}.cilog")
    path.write_bytes(segment_header(pid=pid, index=index, global_rank=global_rank) + records.tobytes())
    if sealed:
        final = path.with_name(path.name + ".sealed")
        os.rename(path, final)
        return final
    return path


class Rank:
    """One writer process: ring + rotating segments."""

    def __init__(self, home: Path, rank: int, nranks: int, capacity: int, segment_records: int, comm_hash: int) -> None:
        self.home = home
        self.rank = rank
        self.nranks = nranks
        self.pid = os.getpid()
        self.comm_hash = comm_hash
        self.segment_records = segment_records
        (home / "shms").mkdir(parents=True, exist_ok=True)
        (home / "inspector_logs").mkdir(parents=True, exist_ok=True)
        self.start_ns = time.time_ns()
        ring_path = home / "shms" / f"comminsight-{self.pid}-{self.start_ns}.ring"
        tmp = ring_path.with_suffix(".tmp")
        create_ring(tmp, capacity, pid=self.pid, start_ns=self.start_ns, host="testhost")
        os.rename(tmp, ring_path)  # the agent never sees a half-initialised ring
        self.ring = RingWriter(ring_path)
        self.segment_index = -1
        self.segment_fd = -1
        self.segment_path: Path | None = None
        self.in_segment = 0
        self.record_seq = 0
        self._open_segment()

    def _open_segment(self) -> None:
        self._seal_segment()
        self.segment_index += 1
        self.segment_path = (
            self.home / "inspector_logs" / f"testhost-{self.pid}-{self.start_ns}-{self.segment_index}.cilog"
        )
        self.segment_fd = os.open(self.segment_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(
            self.segment_fd,
            segment_header(
                pid=self.pid,
                index=self.segment_index,
                global_rank=self.rank,
                world_size=self.nranks,
                start_ns=self.start_ns,
            ),
        )
        self.in_segment = 0

    def _seal_segment(self) -> None:
        if self.segment_fd >= 0 and self.segment_path is not None:
            os.close(self.segment_fd)
            os.rename(self.segment_path, self.segment_path.with_name(self.segment_path.name + ".sealed"))
            self.segment_fd = -1

    def emit(self, seq: int, state: int | None = None) -> None:
        record = make_records(
            1,
            comm_hash=self.comm_hash,
            rank=self.rank,
            nranks=self.nranks,
            pid=self.pid,
            first_seq=seq,
            first_record_seq=self.record_seq,
            state=state,
        )
        self.record_seq += 1
        self.ring.write(record)
        os.write(self.segment_fd, record.tobytes())
        self.in_segment += 1
        if self.in_segment >= self.segment_records:
            self._open_segment()

    def close(self) -> None:
        self._seal_segment()
        self.ring.close(clean=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--home", type=Path, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--nranks", type=int, required=True)
    parser.add_argument("--ops", type=int, default=100)
    parser.add_argument("--interval", type=float, default=0.0, help="seconds between ops")
    parser.add_argument("--capacity", type=int, default=1024)
    parser.add_argument("--segment-records", type=int, default=50)
    parser.add_argument("--comm-hash", type=lambda s: int(s, 0), default=0xABCDEF0123456789)
    parser.add_argument("--hang-at", type=int, default=-1)
    parser.add_argument("--hang-role", choices=["never", "inside"], default="inside")
    parser.add_argument("--ready", type=Path, help="touch this file once the ring exists")
    args = parser.parse_args(argv)
    rank = Rank(args.home, args.rank, args.nranks, args.capacity, args.segment_records, args.comm_hash)
    if args.ready:
        args.ready.touch()
    for seq in range(args.ops):
        if seq == args.hang_at:
            if args.hang_role == "inside":
                rank.emit(seq, state=C["CI_STATE_TIMEOUT"])  # the profiler's in-flight snapshot
            time.sleep(3600)  # hung: the test kills us
        rank.emit(seq)
        if args.interval:
            time.sleep(args.interval)
    rank.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
