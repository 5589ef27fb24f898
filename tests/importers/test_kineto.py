"""Kineto importer: the public HTA trace, multi-rank directories, and broken traces."""

from __future__ import annotations

import gzip
import json

import polars as pl
import pyarrow as pa
import pytest

from comminsight.analysis import analyze_hang
from comminsight.importers import EvidenceError, detect, kineto, load


def test_hta_kineto_trace_yields_collectives_with_group_and_sequence(kineto_public):
    assert detect(kineto_public).name == "kineto"
    df = pl.from_arrow(load(kineto_public))
    ops = df.filter(pl.col("op") != "compute")
    assert ops["rank"].unique().to_list() == [0]
    assert sorted(ops["op"].unique()) == ["all_reduce", "broadcast"]
    assert ops["comm_id"].unique().to_list() == ["0"]
    assert ops["comm_desc"].unique().to_list() == ["default_pg"]
    assert ops["comm_ranks"][0].to_list() == [0, 1]
    assert ops["seq"].to_list() == list(range(len(ops)))  # one sequence per group, in enqueue order
    assert (ops["end_ns"] > ops["start_ns"]).all()
    assert (ops["start_ns"] > ops["enqueue_ns"]).all()
    assert ops["dtype"].null_count() == 0
    assert (ops["bytes"] > 0).all()


def test_hta_kineto_profiler_steps_become_spans_and_label_the_ops(kineto_public):
    df = pl.from_arrow(load(kineto_public))
    spans = df.filter(pl.col("op") == "compute").sort("start_ns")
    assert spans["step"].to_list() == [4, 5, 6]
    ops = df.filter(pl.col("op") != "compute")
    for span in spans.iter_rows(named=True):
        inside = ops.filter((pl.col("enqueue_ns") >= span["start_ns"]) & (pl.col("enqueue_ns") <= span["end_ns"]))
        assert not inside.is_empty()
        assert inside["step"].unique().to_list() == [span["step"]]


def test_two_rank_traces_in_a_directory_show_no_hang(kineto_public, tmp_path):
    trace = json.loads(gzip.decompress(kineto_public.read_bytes()))
    directory = tmp_path / "traces"
    directory.mkdir()
    for rank in (0, 1):
        trace["distributedInfo"]["rank"] = rank
        (directory / f"rank{rank}.pt.trace.json").write_text(json.dumps(trace))
    table = load(directory)
    assert pl.from_arrow(table)["rank"].unique().sort().to_list() == [0, 1]
    assert analyze_hang(table)["verdict"] == "no_hang"


def test_broken_traces_fail_clearly(tmp_path, kineto_public, monkeypatch):
    data = kineto_public.read_bytes()
    truncated = tmp_path / "cut.json.gz"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(EvidenceError, match="cannot read"):
        load(truncated)
    no_events = tmp_path / "x.json"
    no_events.write_text('{"schemaVersion": 1, "traceEvents": 5}')
    with pytest.raises(EvidenceError, match="traceEvents"):
        load(no_events)
    no_rank = tmp_path / "trace.json"
    no_rank.write_text('{"schemaVersion": 1, "traceEvents": []}')
    with pytest.raises(EvidenceError, match="rank"):
        load(no_rank)
    monkeypatch.setattr(kineto, "MAX_JSON_BYTES", 1000)
    with pytest.raises(EvidenceError, match="limit"):
        load(kineto_public)


def test_a_trace_without_collectives_is_refused(tmp_path):
    path = tmp_path / "rank3.json"
    path.write_text('{"schemaVersion": 1, "traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1}]}')
    with pytest.raises(EvidenceError, match="no NCCL operations"):
        load(path)


def test_a_plain_json_trace_is_not_taken_for_a_flight_recorder_dump(kineto_public, tmp_path):
    trace = json.loads(gzip.decompress(kineto_public.read_bytes()))
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))  # distributedInfo.pg_config sits in the first bytes
    assert detect(path).name == "kineto"


def test_seq_from_the_trace_wins_over_the_ordinal(tmp_path):
    kernel = {"Collective name": "allreduce", "In msg nelems": 4, "dtype": "Float", "Process Group Name": "3"}
    events = [
        {
            "ph": "X",
            "cat": "kernel",
            "name": "ncclDevKernel_AllReduce",
            "ts": 10.0 * i,
            "dur": 1.0,
            "args": {**kernel, "External id": i},
        }
        for i in range(3)
    ]
    events += [
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": "record_param_comms",
            "ts": 10.0 * i - 1,
            "dur": 0.5,
            "args": {"External id": i, "Seq": 40 + i},
        }
        for i in range(3)
    ]
    path = tmp_path / "rank2.json"
    path.write_text(json.dumps({"schemaVersion": 1, "distributedInfo": {"rank": 2}, "traceEvents": events}))
    df = pl.from_arrow(load(path))
    assert df["seq"].to_list() == [40, 41, 42]
    assert df["rank"].unique().to_list() == [2]


def _unlike_traces() -> list[dict]:
    """Four ranks' traces that differ in every way the table depends on per trace: clock base, step
    spans, where group members are listed, kernel order, sequence numbers. External ids repeat
    across traces (each process counts its own), so a kernel must find its CPU op in its own trace."""
    from evidence_samples import kineto_trace

    traces = [kineto_trace(rank, 4, 900, seed=11, nccl_every=9) for rank in range(4)]
    traces[1]["baseTimeNanoseconds"] += 5_000_000_123
    traces[1]["traceEvents"] = [e for e in traces[1]["traceEvents"] if not e["name"].startswith("ProfilerStep")]
    traces[2]["distributedInfo"]["pg_config"] = [{"pg_name": "0", "pg_desc": "from_config", "ranks": [0, 1, 2, 3]}]
    for event in traces[2]["traceEvents"]:
        event.get("args", {}).pop("Process Group Ranks", None)
        event.get("args", {}).pop("Process Group Description", None)
    nccl = [e for e in traces[2]["traceEvents"] if e["name"].startswith("nccl")]
    others = [e for e in traces[2]["traceEvents"] if not e["name"].startswith("nccl")]
    traces[2]["traceEvents"] = others + nccl[::-1]  # listed by stream, last enqueued first
    for i, event in enumerate(e for e in traces[3]["traceEvents"] if e["name"] == "record_param_comms"):
        event["args"]["Seq"] = 100 + 2 * i
    return traces


def test_a_directory_of_unlike_traces_reads_as_its_traces_one_by_one(tmp_path):
    directory = tmp_path / "traces"
    directory.mkdir()
    for trace in _unlike_traces():
        (directory / f"rank{trace['distributedInfo']['rank']}.pt.trace.json").write_text(json.dumps(trace))
    together = load(directory)
    one_by_one = pa.concat_tables([load(path) for path in sorted(directory.iterdir())]).combine_chunks()
    assert together.equals(one_by_one)
    df = pl.from_arrow(together)
    ops = df.filter(pl.col("op") != "compute")
    assert ops.filter(pl.col("rank") == 2)["comm_desc"].unique().to_list() == ["from_config"]
    assert ops.filter(pl.col("rank") == 3)["seq"].min() == 100
    assert ops.filter(pl.col("rank") == 1)["step"].null_count() == len(ops.filter(pl.col("rank") == 1))
    assert ops.filter(pl.col("rank") == 0)["step"].null_count() == 0


def test_a_bad_trace_among_good_ones_is_named(tmp_path):
    traces = _unlike_traces()
    kernel = next(e for e in traces[2]["traceEvents"] if e["name"].startswith("nccl"))
    kernel["args"]["In msg nelems"] = 1 << 70  # past the 64-bit range of the count column
    directory = tmp_path / "traces"
    directory.mkdir()
    for trace in traces:
        (directory / f"rank{trace['distributedInfo']['rank']}.pt.trace.json").write_text(json.dumps(trace))
    with pytest.raises(EvidenceError, match=r"rank2\.pt\.trace\.json: .*out of range"):
        load(directory)
