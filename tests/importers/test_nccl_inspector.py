"""NCCL Inspector importer: both line layouts of the JSON output, and malformed logs."""

from __future__ import annotations

import json

import polars as pl
import pytest
from evidence_samples import inspector_lines

from comminsight.analysis import analyze_hang
from comminsight.importers import EvidenceError, detect, load, nccl_inspector


@pytest.fixture
def inspector_dir(tmp_path):
    directory = tmp_path / "nccl-inspector-1234"
    directory.mkdir()
    for rank in range(4):
        # The world communicator, plus a 2-rank sub-communicator where this process has another rank.
        lines = inspector_lines(rank=rank, n_ranks=4, seed=rank, batched=rank % 2 == 1)
        lines += inspector_lines(rank=rank % 2, n_ranks=2, comm=f"0xsub{rank // 2}", n=2, seed=rank)
        (directory / f"host0-pid{1000 + rank}.log").write_text("\n".join(lines) + "\n")
    return directory


def test_inspector_logs_import_with_global_ranks_and_peers(inspector_dir):
    assert detect(inspector_dir).name == "nccl_inspector"
    df = pl.from_arrow(load(inspector_dir))
    assert df["rank"].unique().sort().to_list() == [0, 1, 2, 3]
    coll = df.filter(~pl.col("is_p2p"))
    assert set(coll["op"].unique()) == {"all_reduce", "all_gather"}
    assert set(coll["seq_kind"].unique()) == {"func"}
    assert (coll["end_ns"] > coll["start_ns"]).all()
    world = df.filter((pl.col("comm_id") == "0x7f8c496ae9f661") & pl.col("is_p2p"))
    # Each process sent to comm rank (r + 1) % n: in the world communicator that is global rank (r + 1) % 4.
    assert sorted(world.select("rank", "peer").rows()) == [(0, 1), (1, 2), (2, 3), (3, 0)]
    assert analyze_hang(df.to_arrow())["verdict"] == "no_hang"


def test_malformed_lines_fail_naming_the_line_and_nothing_is_returned(inspector_dir):
    path = inspector_dir / "host0-pid1000.log"
    lines = path.read_text().splitlines()
    lines.insert(2, '{"coll_perf": ')
    path.write_text("\n".join(lines))
    with pytest.raises(EvidenceError, match=r"host0-pid1000.log:3"):
        load(inspector_dir)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"header": {"id": "0x1", "rank": 0, "n_ranks": 2}, "metadata": {}, "coll_perf": {"coll_sn": 1}}, "name"),
        (
            {"header": {"id": "0x1", "rank": -3, "n_ranks": 2}, "metadata": {}, "coll_perf": {"coll": "AllReduce"}},
            "header.rank",
        ),
        (
            {
                "header": {"id": "0x1", "rank": 0, "n_ranks": 2},
                "metadata": {},
                "coll_perf": {"coll": "X", "coll_sn": "1"},
            },
            "coll_sn",
        ),
        ({"header": [], "metadata": {}, "coll_perf": {}}, "must be objects"),
    ],
)
def test_invalid_records_are_refused(tmp_path, line, message):
    path = tmp_path / "h-pid1.log"
    good = {"header": {"id": "0x1", "rank": 0, "n_ranks": 2}, "metadata": {"hostname": "h", "pid": 1}}
    path.write_text(json.dumps(good) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(EvidenceError, match=message):
        nccl_inspector.load(path)


def test_a_payload_before_any_header_is_refused(tmp_path):
    path = tmp_path / "h-pid1.log"
    path.write_text(json.dumps({"coll_perf": {"coll": "AllReduce", "coll_sn": 1}}) + "\n")
    with pytest.raises(EvidenceError, match="before any header"):
        nccl_inspector.load(path)


def test_overlong_lines_are_refused(inspector_dir, monkeypatch):
    monkeypatch.setattr(nccl_inspector, "MAX_LINE_BYTES", 64)
    with pytest.raises(EvidenceError, match="longer than"):
        load(inspector_dir)
