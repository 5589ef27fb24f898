"""Hang analysis on awkward evidence: empty dumps, ranks with nothing recorded, coalesced ops, partial traces."""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from comminsight.analysis import analyze_hang
from comminsight.cli import app
from comminsight.evidence import SCHEMA, conform
from comminsight.importers import EvidenceError, load

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "importers"))
from evidence_samples import fr_dump


def _write(directory: Path, dumps: dict[int, dict]) -> Path:
    directory.mkdir()
    for rank, dump in dumps.items():
        (directory / f"_dump_{rank}").write_bytes(pickle.dumps(dump, protocol=2))
    return directory


def test_dumps_without_entries_are_insufficient_evidence_not_a_crash(tmp_path):
    dumps = {r: {**fr_dump(r, [0, 1, 2], range(1)), "entries": [], "pg_status": {}} for r in range(3)}
    report = analyze_hang(load(_write(tmp_path / "d", dumps)))
    assert report["verdict"] == "insufficient_evidence"
    assert report["root_cause_ranks"] == []


def test_a_rank_whose_dump_is_empty_is_missing_where_the_others_wait(tmp_path):
    dumps = {r: fr_dump(r, [0, 1, 2], range(5, 7), completed=4) for r in (0, 2)}
    dumps[1] = {**fr_dump(1, [0, 1, 2], range(1)), "entries": [], "pg_status": {}}
    report = analyze_hang(load(_write(tmp_path / "d", dumps)))
    assert report["verdict"] == "hang"
    assert report["root_cause_ranks"] == [1]
    assert report["stuck_groups"][0]["missing_ranks"] == [1]
    assert report["failures"]["no_evidence_ranks"] == []  # it dumped: present, just not there


def _rows(rows: list[dict]) -> pa.Table:
    base = {
        "comm_id": "g",
        "comm_desc": "DATA_PARALLEL_GROUP",
        "comm_ranks": [0, 1],
        "is_p2p": False,
        "seq_kind": "comm",
    }
    return conform(pa.Table.from_pylist([{**base, "source": "test", **row} for row in rows], schema=SCHEMA))


def test_coalesced_operations_on_one_sequence_are_not_a_mismatch():
    rows = []
    for rank in (0, 1):
        rows.append({"rank": rank, "op": "all_reduce", "seq": 1, "count": 8, "dtype": "float32", "state": "completed"})
        # Two tensors reduced as one coalesced group: two rows on seq 2, in a different order per rank.
        ops = [("all_reduce", 4), ("all_reduce", 16)] if rank == 0 else [("all_reduce", 16), ("all_reduce", 4)]
        for op, count in ops:
            rows.append({"rank": rank, "op": op, "seq": 2, "count": count, "dtype": "float32", "state": "started"})
    report = analyze_hang(_rows(rows))
    assert report["mismatches"] == []
    assert report["stuck_groups"][0]["kind"] == "all_inside"


def test_uneven_all_to_all_splits_are_not_a_mismatch():
    rows = [
        {"rank": r, "op": "all_to_all", "seq": 3, "count": 100 + r, "dtype": "bfloat16", "state": "scheduled"}
        for r in (0, 1)
    ]
    assert analyze_hang(_rows(rows))["mismatches"] == []


def test_a_partial_trace_of_one_rank_is_insufficient_in_text_and_json(tmp_path):
    trace = tmp_path / "rank0.json"
    events = [
        {
            "ph": "X",
            "cat": "kernel",
            "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
            "ts": 10.0 * i,
            "dur": 5.0,
            "args": {
                "Collective name": "allreduce",
                "In msg nelems": 4,
                "dtype": "Float",
                "Process Group Name": "0",
                "Process Group Ranks": "[0, 1]",
                "Group size": 2,
            },
        }
        for i in range(3)
    ]
    trace.write_text(json.dumps({"schemaVersion": 1, "distributedInfo": {"rank": 0}, "traceEvents": events}))
    text = CliRunner().invoke(app, ["analyze", "hang", str(trace)])
    assert text.exit_code == 0, text.output
    assert text.output.splitlines()[0].startswith("Verdict: insufficient_evidence")
    report = json.loads(CliRunner().invoke(app, ["analyze", "hang", str(trace), "--format", "json"]).output)
    assert report["failures"]["no_evidence_ranks"] == [1]


def test_analyze_hang_refuses_unknown_input_with_a_clear_error(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    result = CliRunner().invoke(app, ["analyze", "hang", str(path)])
    assert result.exit_code == 2
    assert "not a recognised evidence format" in result.output


def test_an_imported_table_of_another_schema_version_is_refused(tmp_path):
    import pyarrow.parquet as pq

    from comminsight.cli.importer import load_evidence

    table = conform(_rows([{"rank": 0, "op": "all_reduce", "seq": 1, "state": "completed"}]))
    table = table.replace_schema_metadata({b"comminsight.schema_version": b"99"})
    pq.write_table(table, tmp_path / "old.parquet")
    with pytest.raises(EvidenceError, match="schema"):
        load_evidence(tmp_path / "old.parquet")
