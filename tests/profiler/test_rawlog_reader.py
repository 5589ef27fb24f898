"""The raw-log and ring readers: valid data reads back; malformed, hostile or oversized files give clear errors."""

from __future__ import annotations

import tarfile
from pathlib import Path

import numpy as np
import pytest

from comminsight.formats import header, rawlog

REAL_NCCL_LOGS = Path(__file__).parent / "data/gpu_lab_h200_nccl2.28.9_logs.tar.gz"


def make_records(n: int, start_seq: int = 0) -> np.ndarray:
    records = np.zeros(n, header.record_dtype())
    records["kind"] = 1
    records["state"] = 1
    records["rank"] = 2
    records["nranks"] = 4
    records["peer"] = -1
    records["comm_hash"] = 0xABCDEF
    records["seq"] = np.arange(start_seq, start_seq + n)
    records["func"] = b"AllReduce"
    records["dtype"] = b"ncclFloat32"
    header.seal_records(records)
    return records


def segment_bytes(records: np.ndarray, **overrides: object) -> bytes:
    hdr = np.zeros(1, header.struct_dtype("ci_log_header"))
    const = header.constants()
    hdr["magic"] = const["CI_LOG_MAGIC"]
    hdr["version"] = const["CI_FORMAT_VERSION"]
    hdr["header_size"] = const["CI_LOG_HEADER_SIZE"]
    hdr["record_size"] = const["CI_RECORD_SIZE"]
    hdr["host"] = b"node-a"
    hdr["global_rank"] = 2
    for key, value in overrides.items():
        hdr[key] = value
    return hdr.tobytes() + records.tobytes()


def ring_bytes(records: np.ndarray, capacity: int, head: int, tail: int, **overrides: object) -> bytes:
    hdr = np.zeros(1, header.struct_dtype("ci_ring_header"))
    const = header.constants()
    hdr["magic"] = const["CI_RING_MAGIC"]
    hdr["version"] = const["CI_FORMAT_VERSION"]
    hdr["header_size"] = const["CI_RING_HEADER_SIZE"]
    hdr["record_size"] = const["CI_RECORD_SIZE"]
    hdr["capacity"] = capacity
    hdr["head"] = head
    hdr["tail"] = tail
    hdr["dropped"] = 7
    for key, value in overrides.items():
        hdr[key] = value
    slots = np.zeros(capacity, header.record_dtype())
    for i, record in zip(range(head - len(records), head), records, strict=True):
        slots[i % capacity] = record
    return hdr.tobytes() + slots.tobytes()


def write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_a_segment_reads_back_its_records_and_header(tmp_path):
    path = write(tmp_path, "a.cilog.sealed", segment_bytes(make_records(10)))
    segment = rawlog.read_segment(path)
    assert segment.header["host"] == "node-a"
    assert segment.table.num_rows == 10
    assert segment.table["seq"].to_pylist() == list(range(10))
    assert set(segment.table["host"].to_pylist()) == {"node-a"}
    assert set(segment.table["global_rank"].to_pylist()) == {2}
    assert segment.invalid_records == 0


def test_a_bad_magic_is_a_clear_error(tmp_path):
    path = write(tmp_path, "a.cilog", segment_bytes(make_records(1), magic=0x1234))
    with pytest.raises(rawlog.RawLogError, match="bad magic"):
        rawlog.read_segment(path)


def test_an_unknown_version_is_a_clear_error(tmp_path):
    path = write(tmp_path, "a.cilog", segment_bytes(make_records(1), version=99))
    with pytest.raises(rawlog.RawLogError, match="format version 99"):
        rawlog.read_segment(path)


def test_a_record_size_other_than_the_contract_is_rejected(tmp_path):
    path = write(tmp_path, "a.cilog", segment_bytes(make_records(1), record_size=128))
    with pytest.raises(rawlog.RawLogError, match="record_size 128"):
        rawlog.read_segment(path)


def test_a_truncated_header_is_a_clear_error(tmp_path):
    path = write(tmp_path, "a.cilog", segment_bytes(make_records(1))[:100])
    with pytest.raises(rawlog.RawLogError, match="shorter than"):
        rawlog.read_segment(path)


def test_an_empty_file_is_a_clear_error(tmp_path):
    with pytest.raises(rawlog.RawLogError):
        rawlog.read_any(write(tmp_path, "a.cilog", b""))


def test_corrupted_records_are_skipped_and_counted(tmp_path):
    data = bytearray(segment_bytes(make_records(5)))
    data[512 + 2 * 256 + 60] ^= 0xFF  # flip a byte inside record 2
    data[512 + 4 * 256 : 512 + 4 * 256 + 4] = b"XXXX"  # break record 4's magic
    segment = rawlog.read_segment(write(tmp_path, "a.cilog", bytes(data)))
    assert segment.table["seq"].to_pylist() == [0, 1, 3]
    assert segment.invalid_records == 2


def test_a_torn_tail_is_skipped_not_fatal(tmp_path):
    data = segment_bytes(make_records(3)) + make_records(1, 3).tobytes()[:77]
    segment = rawlog.read_segment(write(tmp_path, "a.cilog", data))
    assert segment.table.num_rows == 3
    assert segment.torn_bytes == 77


def test_an_oversized_file_is_refused_before_reading(tmp_path):
    path = write(tmp_path, "a.cilog", segment_bytes(make_records(8)))
    with pytest.raises(rawlog.RawLogError, match="larger than"):
        rawlog.read_segment(path, max_bytes=1024)


def test_random_bytes_are_refused(tmp_path):
    rng = np.random.default_rng(1)
    path = write(tmp_path, "a.cilog", rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(rawlog.RawLogError):
        rawlog.read_any(path)


def test_a_directory_reads_every_segment_and_ring_and_skips_other_files(tmp_path):
    write(tmp_path, "a-0.cilog.sealed", segment_bytes(make_records(4)))
    write(tmp_path, "a-1.cilog", segment_bytes(make_records(3, 4)))
    write(tmp_path, "notes.txt", b"not a segment")
    table = rawlog.read_logs(tmp_path)
    assert sorted(table["seq"].to_pylist()) == list(range(7))


def test_an_empty_directory_gives_an_empty_table(tmp_path):
    assert rawlog.read_logs(tmp_path).num_rows == 0


def test_a_ring_reads_the_committed_window_across_the_wrap(tmp_path):
    records = make_records(6, 10)  # head 22, capacity 8: slots of 16..21 wrap
    path = write(tmp_path, "x.ring", ring_bytes(records, capacity=8, head=22, tail=16))
    ring = rawlog.read_any(path)
    assert ring.table["seq"].to_pylist() == list(range(10, 16))
    assert ring.extra == {"head": 22, "tail": 16, "dropped": 7, "lost": 0}


def test_a_ring_window_is_at_most_its_capacity(tmp_path):
    records = make_records(8)
    path = write(tmp_path, "x.ring", ring_bytes(records, capacity=8, head=20, tail=0))
    assert rawlog.read_ring(path).table.num_rows == 8


def test_a_ring_with_a_bad_capacity_or_indices_is_rejected(tmp_path):
    bad = ring_bytes(make_records(1), capacity=8, head=1, tail=0)
    at = header.struct_dtype("ci_ring_header").fields["capacity"][1]

    def with_capacity(value: int) -> bytes:
        return bad[:at] + value.to_bytes(4, "little") + bad[at + 4 :]

    bad_capacity = write(tmp_path, "a.ring", with_capacity(6))
    with pytest.raises(rawlog.RawLogError, match="power of two"):
        rawlog.read_ring(bad_capacity)
    tail_ahead = write(tmp_path, "b.ring", ring_bytes(np.zeros(0, header.record_dtype()), capacity=8, head=1, tail=5))
    with pytest.raises(rawlog.RawLogError, match="ahead of head"):
        rawlog.read_ring(tail_ahead)
    huge = write(tmp_path, "c.ring", with_capacity(1 << 30))
    with pytest.raises(rawlog.RawLogError, match="truncated"):
        rawlog.read_ring(huge)


def test_real_nccl_logs_join_across_ranks_by_comm_func_and_seq(tmp_path):
    """Logs written by the plugin inside NCCL 2.28.9 (8 ranks of DDP on an H200, scripts/gpu_lab.py)."""
    with tarfile.open(REAL_NCCL_LOGS) as tar:
        tar.extractall(tmp_path, filter="data")
    table = rawlog.read_logs(tmp_path / "inspector_logs")
    assert table.num_rows > 1000
    keys = table.group_by(["comm_hash", "func", "seq"]).aggregate([("rank", "count_distinct"), ("nranks", "max")])
    assert (keys["rank_count_distinct"].to_numpy() == keys["nranks_max"].to_numpy()).all()
    assert set(table["state"].to_pylist()) == {1}
    assert (table["gpu_end_ns"].to_numpy() >= table["gpu_start_ns"].to_numpy()).all()
