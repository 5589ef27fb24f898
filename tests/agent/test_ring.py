"""Ring consumer: reads what was committed, in order, once; rejects malformed rings with a clear reason."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pywriter import make_records

from comminsight.formats import header
from comminsight.formats.ring import RingError, RingReader, RingWriter, create_ring

C = header.constants()


def ring_with(path: Path, n: int, capacity: int = 16) -> RingWriter:
    create_ring(path, capacity, pid=123, start_ns=99, host="h")
    writer = RingWriter(path)
    writer.write(make_records(n, pid=123))
    return writer


def fnv1a_words(record: np.void) -> int:
    """The header's definition, one record at a time: FNV-1a over its u32 words, checksum word as zero."""
    words = np.frombuffer(record.tobytes(), "<u4").copy()
    words[1] = 0
    h = 2166136261
    for word in words.tolist():
        h = ((h ^ word) * 16777619) & 0xFFFFFFFF
    return h


def test_record_checksums_match_the_contract_definition() -> None:
    records = make_records(100)
    assert header.record_checksums(records).tolist() == [fnv1a_words(r) for r in records]
    assert header.record_checksums(records[:0]).tolist() == []


def test_reader_returns_committed_records_in_order_as_columns(tmp_path: Path) -> None:
    ring_with(tmp_path / "r.ring", 10)
    reader = RingReader(tmp_path / "r.ring")
    batch = reader.read(4)
    assert list(batch.records["seq"]) == [0, 1, 2, 3]
    rest = reader.read(100)
    assert list(rest.records["seq"]) == list(range(4, 10))
    assert reader.read(100).records.n == 0
    assert rest.records["func"][0] == b"AllReduce"


def test_records_wrap_around_the_ring(tmp_path: Path) -> None:
    writer = ring_with(tmp_path / "r.ring", 12, capacity=16)
    reader = RingReader(tmp_path / "r.ring")
    reader.read(12)
    reader.publish()
    writer.write(make_records(10, pid=123, first_seq=12, first_record_seq=12))
    batch = reader.read(100)
    assert list(batch.records["seq"]) == list(range(12, 22))


def test_full_ring_drops_and_counts_what_did_not_fit(tmp_path: Path) -> None:
    ring_with(tmp_path / "r.ring", 20, capacity=16)
    reader = RingReader(tmp_path / "r.ring")
    assert reader.counters()["dropped"] == 4
    assert len(reader.read(100).records) == 16


def test_tail_is_published_only_when_asked_so_a_crash_rereads(tmp_path: Path) -> None:
    ring_with(tmp_path / "r.ring", 8)
    first = RingReader(tmp_path / "r.ring")
    first.read(5)
    first.close()  # "crash" before publish
    again = RingReader(tmp_path / "r.ring")
    assert list(again.read(100).records["seq"]) == list(range(8))


def test_a_checkpointed_cursor_resumes_past_the_published_tail(tmp_path: Path) -> None:
    ring_with(tmp_path / "r.ring", 8)
    reader = RingReader(tmp_path / "r.ring", cursor=5)
    assert list(reader.read(100).records["seq"]) == [5, 6, 7]
    # a cursor beyond head is not believed
    assert RingReader(tmp_path / "r.ring", cursor=50).cursor == 0


def test_a_ring_whose_writer_died_is_read_up_to_what_was_committed(tmp_path: Path) -> None:
    writer = ring_with(tmp_path / "r.ring", 6)
    writer.close(clean=False)
    reader = RingReader(tmp_path / "r.ring")
    assert reader.info.writer_pid == 123
    assert not reader.info.writer_closed
    assert len(reader.read(100).records) == 6


def test_corrupted_records_are_skipped_and_counted(tmp_path: Path) -> None:
    ring_with(tmp_path / "r.ring", 6)
    raw = bytearray((tmp_path / "r.ring").read_bytes())
    raw[C["CI_RING_HEADER_SIZE"] + 2 * 256 + 100] ^= 0xFF  # flip a byte in record 2
    raw[C["CI_RING_HEADER_SIZE"] + 4 * 256] ^= 0xFF  # break record 4's magic
    (tmp_path / "r.ring").write_bytes(bytes(raw))
    batch = RingReader(tmp_path / "r.ring").read(100)
    assert batch.corrupt == 2
    assert list(batch.records["seq"]) == [0, 1, 3, 5]


def _patch_header(path: Path, field: str, value: int) -> None:
    dtype = header.struct_dtype("ci_ring_header")
    raw = bytearray(path.read_bytes())
    hdr = np.frombuffer(raw, dtype=dtype, count=1).copy()
    hdr[field] = value
    raw[: dtype.itemsize] = hdr.tobytes()
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("magic", 0x1234, "bad magic"),
        ("version", 99, "unsupported version 99"),
        ("record_size", 128, "record_size 128"),
        ("capacity", 12, "not a power of two"),
        ("capacity", 1 << 20, "truncated ring"),
    ],
)
def test_malformed_ring_headers_are_refused_with_the_reason(
    tmp_path: Path, field: str, value: int, message: str
) -> None:
    ring_with(tmp_path / "r.ring", 2)
    _patch_header(tmp_path / "r.ring", field, value)
    with pytest.raises(RingError, match=message):
        RingReader(tmp_path / "r.ring")


def test_truncated_and_empty_ring_files_are_refused(tmp_path: Path) -> None:
    (tmp_path / "empty.ring").write_bytes(b"")
    with pytest.raises(RingError, match="truncated ring"):
        RingReader(tmp_path / "empty.ring")
    ring_with(tmp_path / "r.ring", 2)
    data = (tmp_path / "r.ring").read_bytes()
    (tmp_path / "r.ring").write_bytes(data[:1000])
    with pytest.raises(RingError, match="truncated ring"):
        RingReader(tmp_path / "r.ring")


def test_impossible_indices_are_an_error_not_garbage(tmp_path: Path) -> None:
    ring_with(tmp_path / "r.ring", 2)
    _patch_header(tmp_path / "r.ring", "head", 1000)
    reader = RingReader(tmp_path / "r.ring")
    with pytest.raises(RingError, match="impossible indices"):
        reader.read(10)
