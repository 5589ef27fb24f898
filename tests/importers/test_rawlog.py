"""Raw-log importer: segments as the profiler writes them, torn tails, and broken headers."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from evidence_samples import write_segment

from comminsight.formats.header import constants
from comminsight.importers import EvidenceError, detect, load


@pytest.fixture
def home(tmp_path):
    logs = tmp_path / "home" / "inspector_logs"
    logs.mkdir(parents=True)
    for rank in range(3):
        write_segment(
            logs / f"node-a-{100 + rank}-1-0.cilog.sealed",
            global_rank=rank + 8,
            comm_rank=rank,
            nranks=3,
            p2p_peer=(rank + 1) % 3,
            seed=rank,
        )
    return tmp_path / "home"


def test_a_comminsight_home_imports_every_segment(home):
    assert detect(home).name == "rawlog"
    df = pl.from_arrow(load(home))
    assert df["rank"].unique().sort().to_list() == [8, 9, 10]  # the segment header's RANK, not the comm rank
    assert df["comm_id"].unique().to_list() == ["0xabcdef0123456789"]
    assert set(df["op"].unique()) == {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "send"}
    coll = df.filter(~pl.col("is_p2p"))
    assert set(coll["seq_kind"].unique()) == {"func"}
    assert set(coll["dtype"].unique()) == {"bfloat16"}
    assert (coll["end_ns"] > coll["start_ns"]).all()
    assert (coll["start_ns"] > coll["enqueue_ns"]).all()
    assert df["host"].unique().to_list() == ["node-a"]
    assert df["workload"].unique().to_list() == ["job-7"]
    # P2P peers are communicator ranks in the records, global ranks in the table.
    sends = df.filter(pl.col("op") == "send").sort("rank")
    assert sends.select("rank", "peer").rows() == [(8, 9), (9, 10), (10, 8)]


def test_states_map_and_abandoned_operations_count_as_failures(tmp_path):
    c = constants()
    states = [c["CI_STATE_COMPLETED"]] * 5 + [c["CI_STATE_ENQUEUED"], c["CI_STATE_TIMEOUT"], c["CI_STATE_ABANDONED"]]
    write_segment(tmp_path / "a-1-1-0.cilog", global_rank=0, comm_rank=0, nranks=1, states=states)
    df = pl.from_arrow(load(tmp_path))
    assert df["state"].to_list()[-3:] == ["enqueued", "started", "abandoned"]


def test_a_torn_tail_and_a_corrupt_record_are_skipped(tmp_path):
    path = tmp_path / "a-1-1-0.cilog"
    write_segment(path, global_rank=-1, comm_rank=2, nranks=4, n=6, torn_tail=True)
    data = bytearray(path.read_bytes())
    data[512 + 256 * 2 + 100] ^= 0xFF  # flip a byte inside the third record
    path.write_bytes(bytes(data))
    df = pl.from_arrow(load(path))
    assert len(df) == 5
    assert df["rank"].unique().to_list() == [2]  # RANK unset: the communicator rank stands in


@pytest.mark.parametrize(
    ("offset", "value", "message"),
    [(8, 99, "version"), (16, 128, "sizes")],
)
def test_bad_headers_fail_clearly(tmp_path, offset, value, message):
    path = tmp_path / "a-1-1-0.cilog"
    write_segment(path, global_rank=0, comm_rank=0, nranks=1)
    data = bytearray(path.read_bytes())
    data[offset : offset + 4] = np.uint32(value).tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(EvidenceError, match=message):
        load(path, "rawlog")


def test_files_that_are_not_segments_are_refused(tmp_path):
    path = tmp_path / "x.cilog"
    path.write_bytes(b"\0" * 600)
    assert not detect_safe(path)
    with pytest.raises(EvidenceError, match="bad magic"):
        load(path, "rawlog")
    short = tmp_path / "y.cilog"
    short.write_bytes(b"CCOMMLOG")
    with pytest.raises(EvidenceError, match="shorter"):
        load(short, "rawlog")


def detect_safe(path) -> bool:
    try:
        return detect(path).name == "rawlog"
    except EvidenceError:
        return False
