"""Evidence directories: every importer lists them the same bounded way."""

from __future__ import annotations

import pytest

import comminsight.importers as importers
from comminsight.importers import EvidenceError


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
