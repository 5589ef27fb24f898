"""Evidence directories: every importer lists them the same bounded way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import comminsight.importers as importers
from comminsight.formats.archive import ArchiveMember, write_archive
from comminsight.importers import EvidenceError
from comminsight.importers.names import evidence_tables


def test_a_directory_with_more_entries_than_the_cap_is_refused_with_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(importers, "MAX_DIRECTORY_ENTRIES", 5)
    for i in range(6):
        (tmp_path / f"trace_{i}.json").write_text('{"traceEvents": []}')
    with pytest.raises(EvidenceError, match="more than 5 entries"):
        importers.evidence_files(tmp_path, lambda p: True)
    assert not importers.directory_holds(tmp_path, lambda p: True)


def test_hidden_files_subdirectories_and_symlinks_are_not_evidence(tmp_path):
    (tmp_path / "rank0.json").write_text("{}")
    (tmp_path / ".rank1.json").write_text("{}")
    (tmp_path / "sub").mkdir()
    outside = tmp_path.parent / "outside.json"
    outside.write_text("{}")
    (tmp_path / "rank2.json").symlink_to(outside)
    assert [p.name for p in importers.evidence_files(tmp_path, lambda p: True)] == ["rank0.json"]


def test_a_single_file_is_its_own_evidence(tmp_path):
    trace = tmp_path / "one.json"
    trace.write_text("{}")
    assert importers.evidence_files(trace, lambda p: False) == [trace]


def _table_archive(path: Path, host: str) -> Path:
    table = json.dumps(
        {
            "format": "comminsight.process_groups",
            "version": 1,
            "host": host,
            "pid": 1,
            "rank": 0,
            "world_size": 2,
            "groups": [{"name": "0", "desc": "default_pg", "ranks": [0, 1], "size": 2, "creation_index": 0}],
        }
    ).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    identity = {"workload_id": "job-1", "node": host, "host": host, "node_ip": "10.0.0.7", "created_ns": 1}
    write_archive(path, identity, [ArchiveMember(f"metadata/process_groups-{host}-1.json", data=table)])
    return path


def test_a_file_takes_communicator_names_from_archives_in_its_own_folder_and_not_from_folders_below_it(tmp_path):
    trace = tmp_path / "trace.parquet"
    trace.write_bytes(b"")  # only its place matters here
    _table_archive(tmp_path / "other-job" / "a.tar.zst", "deep")
    assert evidence_tables(trace) == []  # a trace saved in /tmp or ~ does not walk everything below it

    _table_archive(tmp_path / "b.tar.zst", "beside")
    assert [t["host"] for t in evidence_tables(trace)] == ["beside"]
    # a directory given is evidence as a whole: its archives at any depth
    assert sorted(t["host"] for t in evidence_tables(tmp_path)) == ["beside", "deep"]
