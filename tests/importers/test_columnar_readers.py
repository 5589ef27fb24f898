"""The importers' whole-column paths: they agree with the careful per-record checks and keep every refusal."""

from __future__ import annotations

import json
import math
import pickle

import polars as pl
import pytest
from evidence_samples import fr_dump, inspector_lines, write_segment

from comminsight.importers import EvidenceError, flight_recorder, kineto, load, nccl_inspector, rawlog
from comminsight.importers.normalise import shape_text


def _inspector_log(tmp_path, name: str, lines: list[str]):
    directory = tmp_path / name
    directory.mkdir()
    (directory / "host0-pid1000.log").write_text("\n".join(lines) + "\n")
    return directory


def test_an_inspector_log_reads_the_same_when_the_columnar_reader_has_to_decline(tmp_path):
    lines = inspector_lines(rank=0, n_ranks=2, n=6) + inspector_lines(rank=0, n_ranks=2, n=3, batched=True)
    plain = load(_inspector_log(tmp_path, "plain", lines))
    # A JSON null (here in a field the table does not use) sends the log to the line-by-line reader.
    with_null = [line.replace('"git_rev": ""', '"git_rev": null') for line in lines]
    assert with_null != lines
    careful = load(_inspector_log(tmp_path, "null", with_null))
    assert careful.equals(plain)
    assert plain.num_rows == 11


def test_an_inspector_line_whose_header_is_null_is_refused(tmp_path):
    good = {"header": {"id": "0x1", "rank": 0, "n_ranks": 2}, "metadata": {"hostname": "h", "pid": 1}}
    path = tmp_path / "h-pid1.log"
    path.write_text(json.dumps(good) + "\n" + json.dumps({"header": None, "metadata": {}, "coll_perf": {}}) + "\n")
    with pytest.raises(EvidenceError, match=r"h-pid1\.log:2: 'header' and 'metadata' must be objects"):
        nccl_inspector.load(path)


def test_an_inspector_kernel_timestamp_of_the_wrong_type_leaves_only_that_time_unknown(tmp_path):
    lines = inspector_lines(rank=0, n_ranks=2, n=3)
    record = json.loads(lines[1])
    record["coll_perf"]["event_trace_ts"]["kernel_events"][0]["kernel_start_ts"] = "soon"
    lines[1] = json.dumps(record)
    df = pl.from_arrow(load(_inspector_log(tmp_path, "odd", lines))).filter(~pl.col("is_p2p"))
    assert df["start_ns"].is_null().to_list() == [False, True, False]
    assert df["end_ns"].null_count() == 0


def test_a_bad_entry_in_a_later_dump_is_named_by_its_file_and_its_own_index(tmp_path):
    for rank in (0, 1):
        dump = fr_dump(rank, [0, 1], range(4))
        if rank == 1:
            dump["entries"][2]["state"] = "melted"
        (tmp_path / f"_dump_{rank}").write_bytes(pickle.dumps(dump, protocol=2))
    with pytest.raises(EvidenceError, match=r"_dump_1: entry 2 has unknown state 'melted'"):
        load(tmp_path)


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ([[1.0, 2]], "non-negative integers"),
        ([[True, 2]], "non-negative integers"),
        ([[1, 2], None], "at most 32 dims"),
        ([[1] * 40], "at most 32 dims"),
        ([[1 << 40, 1 << 40]], "too many elements"),
        ("4x4", "input_sizes"),
    ],
)
def test_tensor_sizes_that_are_not_plain_shapes_are_refused(tmp_path, sizes, message):
    dump = fr_dump(0, [0, 1], range(3))
    dump["entries"][1]["input_sizes"] = sizes
    (tmp_path / "_dump_0").write_bytes(pickle.dumps(dump, protocol=2))
    with pytest.raises(EvidenceError, match=message):
        flight_recorder.load(tmp_path / "_dump_0")


def test_entries_without_optional_fields_take_the_documented_defaults(tmp_path):
    dump = fr_dump(0, [0, 1], range(3))
    for entry in dump["entries"]:
        del entry["state"], entry["is_p2p"], entry["input_dtypes"]
    path = tmp_path / "rank_0.json"
    path.write_text(json.dumps(dump))
    df = pl.from_arrow(load(path)).filter(pl.col("op") != "progress")
    assert df["state"].to_list() == ["scheduled"] * 3
    assert not df["is_p2p"].any()
    assert df["dtype"].null_count() == 3
    assert df["count"].to_list() == [512] * 3
    assert df["bytes"].null_count() == 3  # no dtype, no item size


def _kineto_trace(tmp_path, ts, external_id=1):
    kernel = {
        "ph": "X",
        "cat": "kernel",
        "name": "ncclDevKernel_AllReduce_RING_LL",
        "ts": ts,
        "dur": 1.0,
        "args": {"Collective name": "allreduce", "External id": external_id, "Process Group Name": "0"},
    }
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": [kernel]}))
    return path


def test_a_kineto_timestamp_out_of_range_is_refused(tmp_path):
    with pytest.raises(EvidenceError, match="out of range"):
        kineto.load(_kineto_trace(tmp_path, 1e300))


def test_a_kineto_external_id_that_cannot_key_a_lookup_does_not_break_the_import(tmp_path):
    df = pl.from_arrow(kineto.load(_kineto_trace(tmp_path, 5.0, external_id=[1, 2])))
    assert df["op"].to_list() == ["all_reduce"]
    assert df["record_id"].null_count() == 1
    assert df["algo"].to_list() == ["RING"]


def test_an_oversized_segment_is_refused(tmp_path, monkeypatch):
    write_segment(tmp_path / "a-0-1-0.cilog", global_rank=0, comm_rank=0, nranks=1)
    monkeypatch.setattr(rawlog, "MAX_SEGMENT_BYTES", 1000)
    with pytest.raises(EvidenceError, match="limit"):
        rawlog.load(tmp_path)


@pytest.mark.parametrize("dtypes", [["Float", 5], "Float", [None], [b"Float"], [["Float"]]])
def test_dtype_lists_that_are_not_names_are_refused(tmp_path, dtypes):
    dump = fr_dump(0, [0, 1], range(3))
    dump["entries"][2]["input_dtypes"] = dtypes
    (tmp_path / "_dump_0").write_bytes(pickle.dumps(dump, protocol=4))  # protocol 2 pickles bytes via a global
    with pytest.raises(EvidenceError, match="entry 2: input_dtypes must be a list of names"):
        flight_recorder.load(tmp_path / "_dump_0")


def test_mixed_dtypes_are_joined_and_give_no_byte_size(tmp_path):
    dump = fr_dump(0, [0, 1], range(2))
    dump["entries"][0]["input_dtypes"] = ["c10::BFloat16", "Float", "BFloat16"]
    dump["entries"][1]["input_dtypes"] = ["BFloat16", "bf16"]
    (tmp_path / "_dump_0").write_bytes(pickle.dumps(dump, protocol=2))
    df = pl.from_arrow(flight_recorder.load(tmp_path / "_dump_0")).filter(pl.col("op") != "progress")
    assert df["dtype"].to_list() == ["bfloat16,float32", "bfloat16"]
    assert df["bytes"].to_list() == [None, 128 * 4 * 2]


def test_dtype_names_holding_the_key_separator_are_still_told_apart(tmp_path):
    dump = fr_dump(0, [0, 1], range(2))
    dump["entries"][0]["input_dtypes"] = ["Float\x1fHalf"]
    dump["entries"][1]["input_dtypes"] = ["Float", "Half"]
    (tmp_path / "_dump_0").write_bytes(pickle.dumps(dump, protocol=2))
    df = pl.from_arrow(flight_recorder.load(tmp_path / "_dump_0")).filter(pl.col("op") != "progress")
    assert df["dtype"].to_list() == ["float\x1fhalf", "float16,float32"]


def test_dumps_give_the_same_table_mapped_one_by_one_or_all_together(tmp_path, monkeypatch):
    for rank in range(6):
        dump = fr_dump(rank, list(range(6)), range(5 + rank), p2p=rank % 2 == 1, completed=rank)
        dump["entries"][0]["input_dtypes"] = ["BFloat16", "Float"]
        (tmp_path / f"_dump_{rank}").write_bytes(pickle.dumps(dump, protocol=2))
    together = flight_recorder.load(tmp_path)
    monkeypatch.setattr(flight_recorder, "BATCH_ENTRIES", 1)
    one_by_one = flight_recorder.load(tmp_path)
    assert together.num_rows > 6 * 5
    assert one_by_one.equals(together)


def _reference_rows(dump: dict) -> list[dict]:
    """Per entry, the straightforward mapping of the columns that come from the entry alone."""
    rows = []
    for e in dump["entries"]:
        sizes = e.get("input_sizes")
        p2p = bool(e.get("is_p2p")) or "send" in e["profiling_name"] or "recv" in e["profiling_name"]
        rows.append(
            {
                "comm_id": e["process_group"][0],
                "seq": e["p2p_seq_id"] if p2p else e["collective_seq_id"],
                "shape": None if sizes is None else shape_text(sizes),
                "count": None if sizes is None else sum(math.prod(s) for s in sizes),
                "state": e["state"],
                "enqueue_ns": e["time_created_ns"],
                "record_id": e["record_id"],
            }
        )
    return rows


def test_flight_recorder_columns_equal_a_per_entry_reference_on_odd_shapes(tmp_path):
    shapes = [None, [], [[]], [(2, 3)], [[1, 2], [3]], [[0]], [[2] * 32], [[4096, 5120]] * 3]
    rows = []
    for rank in range(4):
        dump = fr_dump(rank, list(range(4)), range(len(shapes) + rank), p2p=rank % 2 == 0)
        for entry, sizes in zip(dump["entries"], shapes * 2, strict=False):
            entry["input_sizes"] = sizes
        (tmp_path / f"_dump_{rank}").write_bytes(pickle.dumps(dump, protocol=2))
        rows += _reference_rows(dump)
    table = pl.from_arrow(flight_recorder.load(tmp_path)).filter(pl.col("op") != "progress")
    assert table.select(list(rows[0])).to_dicts() == rows
