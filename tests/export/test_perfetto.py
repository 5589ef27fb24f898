"""The Perfetto (Chrome JSON) export: what a user sees when opening the trace."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from comminsight.evidence import conform, empty_table
from comminsight.export.perfetto import trace_json, write_trace

MS = 1_000_000


def _ops(rows: list[dict]) -> pa.Table:
    if not rows:
        return empty_table()
    defaults = {"comm_id": "c0", "is_p2p": False, "state": "completed", "source": "table", "stream": 7}
    return conform(pa.Table.from_pylist([{**defaults, **row} for row in rows]))


def _events(table: pa.Table) -> list[dict]:
    return json.loads(trace_json(table))["traceEvents"]


def test_each_executed_operation_is_a_slice_on_its_rank_and_stream():
    table = _ops(
        [
            {"rank": 0, "op": "all_reduce", "seq": 0, "start_ns": 10 * MS, "end_ns": 12 * MS, "bytes": 1024},
            {"rank": 1, "op": "all_reduce", "seq": 0, "start_ns": 11 * MS, "end_ns": 12 * MS, "bytes": 1024},
        ]
    )
    slices = [e for e in _events(table) if e["ph"] == "X"]
    assert sorted((e["pid"], e["ts"], e["dur"]) for e in slices) == [(0, 10_000.0, 2_000.0), (1, 11_000.0, 1_000.0)]
    assert all(e["name"] == "all_reduce" and e["args"]["bytes"] == 1024 for e in slices)


def test_ranks_and_streams_are_named_tracks():
    table = _ops([{"rank": 3, "op": "all_gather", "seq": 0, "start_ns": MS, "end_ns": 2 * MS, "host": "node-a"}])
    names = {(e["name"], e["args"]["name"]) for e in _events(table) if e["ph"] == "M" and "name" in e["args"]}
    assert ("process_name", "rank 3 · node-a") in names
    assert ("thread_name", "stream 0x7") in names


def test_an_operation_that_never_started_is_an_instant_marked_with_its_state():
    table = _ops([{"rank": 2, "op": "all_to_all", "seq": 5, "enqueue_ns": 5 * MS, "state": "enqueued"}])
    (instant,) = [e for e in _events(table) if e["ph"] == "i"]
    assert instant["name"] == "all_to_all (enqueued)"
    assert instant["ts"] == 5_000.0
    assert "dur" not in instant


def test_sends_are_joined_to_their_receives_by_flow_arrows():
    rows = []
    for k in range(2):
        t = (10 + 10 * k) * MS
        rows.append({"rank": 0, "op": "send", "is_p2p": True, "peer": 1, "seq": k, "start_ns": t, "end_ns": t + MS})
        rows.append(
            {"rank": 1, "op": "recv", "is_p2p": True, "peer": 0, "seq": k, "start_ns": t + MS // 2, "end_ns": t + MS}
        )
    events = _events(_ops(rows))
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    finishes = {e["id"]: e for e in events if e["ph"] == "f"}
    assert len(starts) == 2
    assert starts.keys() == finishes.keys()
    for flow_id, start in starts.items():
        assert (start["pid"], finishes[flow_id]["pid"]) == (0, 1)
        assert finishes[flow_id]["ts"] - start["ts"] == pytest.approx(500.0)


def test_an_empty_table_gives_a_valid_empty_trace(tmp_path):
    out = tmp_path / "trace.json"
    assert write_trace(_ops([]), out) == 0
    assert json.loads(out.read_text()) == {"displayTimeUnit": "ns", "traceEvents": []}
    assert not (tmp_path / "trace.json.tmp").exists()
