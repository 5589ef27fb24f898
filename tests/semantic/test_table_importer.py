"""Per-operation tables (CSV/Parquet): column mapping, units, per-step clocks, hostile input."""

from __future__ import annotations

import os

import polars as pl
import pytest

from comminsight.importers import EvidenceError, detect, load
from comminsight.importers.table import lay_steps_end_to_end, map_columns, normalise_op


def _write_csv(path, text: str):
    path.write_text(text)
    return path


def test_a_csv_with_common_column_names_is_detected_and_loaded(tmp_path) -> None:
    path = _write_csv(
        tmp_path / "ops.csv",
        "rank,op,start_us,duration_us,comm_id,seq,bytes\n"
        "0,allreduce,10,5,dp0,0,1024\n1,allreduce,12,3,dp0,0,1024\n0,all_gather,30,4,dp0,1,2048\n1,all_gather,31,3,dp0,1,2048\n",
    )
    assert detect(path).name == "table"
    df = pl.from_arrow(load(path))
    assert df.get_column("op").to_list() == ["all_reduce", "all_gather", "all_reduce", "all_gather"]
    assert df.get_column("start_ns").to_list()[:2] == [10_000, 30_000]  # microseconds became nanoseconds
    assert df.get_column("end_ns").to_list()[0] == 15_000
    assert df.get_column("source").unique().to_list() == ["table"]


def test_operation_names_map_onto_schema_ops() -> None:
    assert normalise_op("grads-reduce-scatter") == "reduce_scatter"
    assert normalise_op("forward-send") == "send"
    assert normalise_op("backward-recv") == "recv"
    assert normalise_op("ncclDevKernel_AllGather_RING_LL") == "all_gather"
    assert normalise_op("optimizer") == "compute"
    assert normalise_op("mystery") == "other"


def test_column_aliases_are_case_insensitive_and_prefer_the_first_match() -> None:
    mapping = map_columns(["Rank", "OpType", "START_TS", "Duration", "stage", "dp_rank"])
    assert mapping == {
        "rank": "Rank",
        "op": "OpType",
        "start": "START_TS",
        "duration": "Duration",
        "pp_rank": "stage",
        "dp_rank": "dp_rank",
    }


def test_per_step_clocks_are_laid_end_to_end_in_step_order() -> None:
    import numpy as np

    step = np.array([5, 5, 9, 9])
    start = np.array([0, 10, 0, 4])
    end = np.array([8, 20, 6, 7])
    s, e = lay_steps_end_to_end(step, start, end)
    assert s.tolist() == [0, 10, 20, 24]
    assert e.tolist() == [8, 20, 26, 27]
    # Already one timeline: unchanged.
    s2, _ = lay_steps_end_to_end(step, np.array([0, 10, 30, 40]), np.array([5, 20, 35, 45]))
    assert s2.tolist() == [0, 10, 30, 40]


def test_pipeline_steps_that_overlap_are_already_one_timeline() -> None:
    import numpy as np

    # Stage 0 starts step 2 at 100 while the last stage finishes step 1 at 125: not a clock restart.
    step = np.array([1, 1, 2, 2])
    start = np.array([0, 25, 100, 125])
    end = np.array([100, 125, 200, 225])
    s, e = lay_steps_end_to_end(step, start, end)
    assert s.tolist() == start.tolist()
    assert e.tolist() == end.tolist()


def test_bytedance_trace_collectives_get_inferred_communicators(bytedance_dir) -> None:
    df = pl.from_arrow(load(bytedance_dir / "trace-ST.parquet"))
    coll = df.filter(~pl.col("is_p2p") & (pl.col("op") != "compute") & (pl.col("comm_size") > 1))
    sizes = dict(coll.group_by("comm_name").agg(pl.col("comm_size").max()).iter_rows())
    assert sizes["grads-reduce-scatter"] == 2  # a data-parallel pair per stage
    assert sizes["params-all-gather"] == 2
    assert sizes["embedding-grads-all-reduce"] == 2  # first and last stage
    assert sizes["optimizer-clip-main-grad"] == 8  # everyone: the gradient-norm reduction
    # Steps follow one another on one timeline.
    spans = df.group_by("step").agg(pl.col("start_ns").min(), pl.col("end_ns").max()).sort("start_ns")
    assert (spans.get_column("start_ns").to_numpy()[1:] >= spans.get_column("end_ns").to_numpy()[:-1] - 1).all()


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("empty.csv", "rank,op,start_ns,duration_ns\n", "no rows"),
        ("noop.csv", "rank,start_ns,duration_ns\n0,1,2\n", "no column for op"),
        ("noend.csv", "rank,op,start_ns\n0,x,1\n", "end time or a duration"),
        ("badrank.csv", "rank,op,start_ns,duration_ns\nzero,allreduce,1,2\n", "rank"),
        ("negrank.csv", "rank,op,start_ns,duration_ns\n-3,allreduce,1,2\n", "negative"),
        ("badtime.csv", "rank,op,start_ns,duration_ns\n0,allreduce,soon,2\n", "not numeric"),
        ("backwards.csv", "rank,op,start_ns,end_ns\n0,allreduce,10,2\n", "end before they start"),
        ("huge.csv", "rank,op,start_s,duration_s\n0,allreduce,1e300,1\n", "out of range"),
        ("nan.csv", "rank,op,start_s,duration_s\n0,allreduce,nan,1\n", "missing or infinite"),
        ("longname.csv", "rank,op,start_ns,duration_ns\n0," + "a" * 5000 + ",1,2\n", "longer than"),
        ("ragged.csv", 'rank,op,start_ns,duration_ns\n0,allreduce,1,2,3,4\n"unterminated\n', "cannot read"),
    ],
)
def test_malformed_tables_are_refused_with_a_clear_error_and_nothing_written(tmp_path, name, content, message) -> None:
    path = _write_csv(tmp_path / name, content)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(EvidenceError, match=message):
        load(path, fmt="table")
    assert sorted(os.listdir(tmp_path)) == before


def test_a_parquet_file_that_is_not_parquet_is_refused(tmp_path) -> None:
    path = tmp_path / "fake.parquet"
    path.write_bytes(b"PAR1" + os.urandom(256))
    with pytest.raises(EvidenceError):
        load(path, fmt="table")


def test_an_oversized_table_is_refused_before_reading(tmp_path, monkeypatch) -> None:
    import comminsight.importers.table as table

    path = _write_csv(tmp_path / "big.csv", "rank,op,start_ns,duration_ns\n" + "0,allreduce,1,2\n" * 100)
    monkeypatch.setattr(table, "MAX_BYTES", 64)
    with pytest.raises(EvidenceError, match="limit"):
        load(path, fmt="table")


def test_files_without_a_rank_op_and_start_are_not_claimed(tmp_path) -> None:
    path = _write_csv(tmp_path / "other.csv", "a,b,c\n1,2,3\n")
    from comminsight.importers.table import detect as table_detect

    assert not table_detect(path)
    assert not table_detect(tmp_path / "missing.csv")
