"""Flight Recorder importer: public dumps, the JSON variant, and hostile pickles."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import polars as pl
import pytest
from evidence_samples import fr_dump

from comminsight.importers import EvidenceError, detect, load
from comminsight.importers import flight_recorder as fr


def test_flight_recorder_nvrx_dumps_import_every_rank_with_groups_and_sequences(fr_public):
    assert detect(fr_public).name == "flight_recorder"
    df = pl.from_arrow(load(fr_public))
    assert sorted(df["rank"].unique().to_list()) == list(range(16))
    ops = df.filter(pl.col("op") != "progress")
    assert set(ops["op"].unique()) <= {
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "all_reduce",
        "broadcast",
        "send",
        "recv",
    }
    assert set(ops["state"].unique()) == {"scheduled"}
    # Collective and P2P sequences are kept apart.
    p2p = ops.filter(pl.col("is_p2p"))
    assert set(p2p["seq_kind"].unique()) == {"p2p"}
    assert set(p2p["op"].unique()) == {"send", "recv"}
    assert set(ops.filter(~pl.col("is_p2p"))["seq_kind"].unique()) == {"comm"}
    # A group's id is the same on every member and its members come from pg_config.
    ep = ops.filter(pl.col("comm_desc") == "EXPERT_MODEL_PARALLEL_GROUP")
    for _, group in ep.group_by("comm_id"):
        members = group["comm_ranks"][0].to_list()
        assert set(group["rank"].unique()) <= set(members)
        assert group["comm_size"].unique().to_list() == [len(members)]
    # P2P peers are global ranks of the same pipeline group.
    for row in p2p.iter_rows(named=True):
        assert row["peer"] in row["comm_ranks"]
        assert row["peer"] != row["rank"]
    # Shapes, dtypes, sizes and creation times are carried.
    first = ops.row(0, named=True)
    assert first["shape"].startswith("[[")
    assert first["dtype"]
    assert first["count"] > 0
    assert first["enqueue_ns"] > 0


def test_pg_status_becomes_completion_watermarks(fr_public):
    df = pl.from_arrow(load(fr_public))
    marks = df.filter((pl.col("op") == "progress") & pl.col("seq").is_not_null())
    assert not marks.is_empty()
    assert set(marks["state"].unique()) == {"completed"}
    # A watermark sits just below the entries it describes.
    for row in marks.head(20).iter_rows(named=True):
        entries = df.filter(
            (pl.col("rank") == row["rank"])
            & (pl.col("comm_id") == row["comm_id"])
            & (pl.col("seq_kind") == row["seq_kind"])
            & (pl.col("op") != "progress")
        )
        assert entries["seq"].max() > row["seq"] >= entries["seq"].min() - 1


def test_json_variant_gives_the_same_rows_as_the_pickle(tmp_path):
    dump = fr_dump(1, [0, 1], range(10, 14), p2p=True, completed=10)
    (tmp_path / "p").mkdir()
    (tmp_path / "j").mkdir()
    (tmp_path / "p" / "rank_1").write_bytes(pickle.dumps(dump, protocol=4))
    (tmp_path / "j" / "rank_1.json").write_text(json.dumps(dump))
    pickled, jsoned = load(tmp_path / "p"), load(tmp_path / "j" / "rank_1.json")
    assert pickled.drop_columns(["source"]).equals(jsoned.drop_columns(["source"]))
    df = pl.from_arrow(pickled)
    send = df.filter(pl.col("op") == "send").row(0, named=True)
    assert send["peer"] == 0
    assert send["seq"] == 5
    assert send["is_p2p"]
    assert df.filter(pl.col("op") == "all_reduce")["bytes"].to_list() == [128 * 4 * 4] * 4


def test_rank_comes_from_the_groups_when_the_file_name_has_none(tmp_path):
    dump = fr_dump(3, [3], range(2))
    (tmp_path / "dump").write_bytes(pickle.dumps(dump))
    assert pl.from_arrow(load(tmp_path / "dump"))["rank"].unique().to_list() == [3]


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_pickle_that_would_run_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    dump = fr_dump(0, [0, 1], range(3))
    dump["entries"][0]["state"] = _Evil(marker)
    path = tmp_path / "_dump_0"
    path.write_bytes(pickle.dumps(dump, protocol=2))
    assert detect(path).name == "flight_recorder"
    with pytest.raises(EvidenceError, match="refusing"):
        load(path)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(entries="nope"), "'entries' must be a list"),
        (lambda d: d["entries"][0].update(collective_seq_id="x"), "must be an integer"),
        (lambda d: d["entries"][1].update(state="exploded"), "unknown state"),
        (lambda d: d["entries"][0].update(input_sizes=[[1, 2]] * 5000), "input_sizes"),
        (lambda d: d["entries"][0].update(input_sizes=[[-1]]), "non-negative"),
        (lambda d: d["entries"][0].pop("process_group"), "no process_group"),
        (lambda d: d["pg_config"]["7"].update(ranks="[0, oops"), "not a list of ranks"),
        (lambda d: d.update(pg_config=[1, 2]), "pg_config"),
    ],
)
def test_malformed_dumps_fail_clearly(tmp_path, mutate, message):
    dump = fr_dump(0, [0, 1], range(3))
    mutate(dump)
    path = tmp_path / "_dump_0"
    path.write_bytes(pickle.dumps(dump))
    with pytest.raises(EvidenceError, match=message):
        load(path)


def test_truncated_and_non_dict_pickles_fail_clearly(tmp_path):
    good = pickle.dumps(fr_dump(0, [0, 1], range(3)), protocol=2)
    (tmp_path / "_dump_0").write_bytes(good[: len(good) // 2])
    with pytest.raises(EvidenceError, match="not a readable"):
        load(tmp_path / "_dump_0")
    (tmp_path / "_dump_0").write_bytes(pickle.dumps(["version", "entries"], protocol=2))
    with pytest.raises(EvidenceError, match="is a dict"):
        load(tmp_path / "_dump_0")


def test_one_corrupt_dump_fails_the_whole_directory(tmp_path):
    (tmp_path / "_dump_0").write_bytes(pickle.dumps(fr_dump(0, [0, 1], range(3)), protocol=2))
    (tmp_path / "_dump_1").write_bytes(b"\x80\x02}q\x00X\x07\x00\x00\x00versionq")
    with pytest.raises(EvidenceError, match="_dump_1"):
        load(tmp_path)


def test_oversized_dumps_and_duplicate_ranks_are_refused(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "_dump_0").write_bytes(pickle.dumps(fr_dump(0, [0, 1], range(3)), protocol=2))
    (tmp_path / "a" / "again_0").write_bytes(pickle.dumps(fr_dump(0, [0, 1], range(3)), protocol=2))
    with pytest.raises(EvidenceError, match="already read"):
        load(tmp_path / "a")
    monkeypatch.setattr(fr, "MAX_FILE_BYTES", 100)
    with pytest.raises(EvidenceError, match="limit"):
        load(tmp_path / "a" / "_dump_0")


def test_other_files_are_not_taken_for_dumps(tmp_path):
    (tmp_path / "notes.txt").write_text("version entries")
    (tmp_path / "trace.json").write_text('{"traceEvents": []}')
    assert not fr.detect(tmp_path / "notes.txt")
    assert not fr.detect(tmp_path / "trace.json")
    assert not fr.detect(tmp_path)
    with pytest.raises(EvidenceError, match="no Flight Recorder dump"):
        fr.load(tmp_path)


def test_a_broken_json_dump_fails_clearly(tmp_path):
    path = tmp_path / "rank_0.json"
    path.write_text('{"version": "2.9", "pg_config": {}, "entries": [')
    with pytest.raises(EvidenceError, match="not a readable"):
        load(path)
