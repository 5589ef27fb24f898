"""Agent ingest rate: ring records/s into columnar batches on one core, against a plain Python loop.

Both readers consume the same ring file (written by the Python ring writer, faithful to
comminsight_ring.h) in the same run:
  - agent:     RingReader.read(batch) (copy out of the mapping + vectorised magic/checksum check)
               then ring.columns() (one contiguous array per field), then publish the tail;
  - baseline:  a Python loop, struct.unpack per record, appending each field to column lists,
               with and without the per-record checksum check.
Prints records/s and the ratio to each baseline. Target (DESIGN §9): >= 5 M records/s.

Run: .venv/bin/python bench/agent_ingest.py [--records 4194304] [--batch 65536]
"""

from __future__ import annotations

import argparse
import os
import struct
import tempfile
import time
from pathlib import Path

import numpy as np

from comminsight.formats import header
from comminsight.formats.ring import RingReader, RingWriter, columns, create_ring

RECORD_FORMAT = struct.Struct("<IIBBBBiiiiiiiQQQQQQQQQQQ24s16s16s16s56s")
WORDS = struct.Struct("<64I")


def sample_records(n: int) -> np.ndarray:
    rng = np.random.default_rng(1)
    records = np.zeros(n, dtype=header.record_dtype())
    records["kind"] = 1
    records["state"] = 1
    records["rank"] = rng.integers(0, 8, n)
    records["nranks"] = 8
    records["comm_hash"] = rng.integers(0, 4, n).astype(np.uint64) * 0x9E3779B97F4A7C15
    records["seq"] = np.arange(n)
    records["bytes"] = rng.integers(1, 1 << 26, n)
    records["enqueue_end_ns"] = 1_700_000_000_000_000_000 + np.arange(n) * 1000
    records["complete_ns"] = records["enqueue_end_ns"] + 500
    records["record_seq"] = np.arange(n)
    records["func"] = b"AllReduce"
    records["dtype"] = b"ncclBfloat16"
    records["comm_name"] = b"dp"
    header.seal_records(records)
    return records


def python_loop(path: Path, n: int, check: bool) -> float:
    """Seconds to read ``n`` records with struct.unpack per record into column lists."""
    magic = header.constants()["CI_RECORD_MAGIC"]
    hdr_size = header.constants()["CI_RING_HEADER_SIZE"]
    data = memoryview(path.read_bytes())
    cols: list[list] = [[] for _ in range(29)]  # 29 fields in RECORD_FORMAT
    t0 = time.perf_counter()
    for i in range(n):
        offset = hdr_size + i * 256
        fields = RECORD_FORMAT.unpack_from(data, offset)
        if fields[0] != magic:
            continue
        if check:
            h = 2166136261
            for index, word in enumerate(WORDS.unpack_from(data, offset)):
                h = ((h ^ (0 if index == 1 else word)) * 16777619) & 0xFFFFFFFF
            if h != fields[1]:
                continue
        for column, value in zip(cols, fields, strict=False):
            column.append(value)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1 << 22, help="records consumed by the agent reader")
    parser.add_argument("--capacity", type=int, default=1 << 18)
    parser.add_argument("--batch", type=int, default=65536)
    parser.add_argument("--baseline-records", type=int, default=100_000)
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core, as the target says
    sample = sample_records(args.capacity)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.ring"
        create_ring(path, args.capacity, pid=os.getpid(), start_ns=1)
        writer = RingWriter(path)
        reader = RingReader(path)
        consumed = 0
        elapsed = 0.0
        while consumed < args.records:
            writer.write_fast(sample)  # refill outside the timed region
            t0 = time.perf_counter()
            while reader.pending:
                batch = reader.read(args.batch)
                cols = columns(batch.records)
                consumed += len(cols["seq"])
                assert batch.corrupt == 0
            reader.publish()
            elapsed += time.perf_counter() - t0
        agent_rate = consumed / elapsed
        # Baselines read the first records of a full ring.
        writer.write_fast(sample)
        n_base = min(args.baseline_records, args.capacity)
        plain = n_base / python_loop(path, n_base, check=False)
        checked = n_base / python_loop(path, min(n_base, 20_000), check=True) * min(n_base, 20_000) / n_base
        writer.close()
        reader.close()
    print(
        f"agent ingest (RingReader + columns, batch {args.batch}): {agent_rate / 1e6:8.2f} M records/s "
        f"({consumed} records)"
    )
    print(
        f"baseline python loop, struct.unpack per record:           {plain / 1e6:8.3f} M records/s "
        f"-> agent is {agent_rate / plain:6.1f}x"
    )
    print(
        f"baseline python loop, struct.unpack + checksum per record: {checked / 1e6:8.3f} M records/s "
        f"-> agent is {agent_rate / checked:6.1f}x"
    )
    print(f"target >= 5 M records/s: {'met' if agent_rate >= 5e6 else 'NOT met'}")


if __name__ == "__main__":
    main()
