"""Sealing is exactly-once whatever moment the agent dies (the journal), and orphans get sealed."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from agentkit import archived_records
from pywriter import make_records, write_segment

from comminsight.agent import archiver as archiver_module
from comminsight.agent.archiver import Archiver
from comminsight.agent.spool import Spool


class Crash(BaseException):
    """Stands for SIGKILL at a chosen point."""


def make_archiver(home: Path) -> Archiver:
    spool = Spool(home / "spool", [], max_bytes=1 << 30, max_age_s=3600)
    a = Archiver(
        home / "logs",
        home / "hang",
        home / "state",
        spool,
        workload_id="job",
        node="n",
        host="h",
        node_ip="",
        orphan_grace_s=0.0,
        proc_root=home / "proc",
    )
    a.recover()
    return a


def segments(home: Path, n: int = 4, per: int = 10) -> None:
    for i in range(n):
        write_segment(home / "logs", make_records(per, pid=77, first_record_seq=i * per), pid=77, index=i)


def test_seal_moves_closed_segments_into_one_archive(tmp_path: Path) -> None:
    segments(tmp_path)
    entry = make_archiver(tmp_path).seal()
    assert entry is not None
    assert entry.records == 40
    assert not list((tmp_path / "logs").iterdir())
    assert len(archived_records(tmp_path / "spool")) == 40
    assert make_archiver(tmp_path).seal() is None  # nothing left to seal


@pytest.mark.parametrize("crash_at", ["write_archive", "after_write", "mid_commit", "after_commit"])
def test_a_seal_killed_at_any_step_ends_with_each_record_in_exactly_one_archive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, crash_at: str
) -> None:
    segments(tmp_path)
    a = make_archiver(tmp_path)
    real_write, real_unlink = archiver_module.write_archive, Path.unlink
    if crash_at == "write_archive":

        def boom(dest, *args, **kwargs):
            dest.with_name(f".{dest.name}.tmp-1").write_bytes(b"partial")
            raise Crash

        monkeypatch.setattr(archiver_module, "write_archive", boom)
    elif crash_at == "after_write":

        def write_then_die(*args, **kwargs):
            real_write(*args, **kwargs)
            raise Crash

        monkeypatch.setattr(archiver_module, "write_archive", write_then_die)
    elif crash_at == "mid_commit":
        calls = []

        def unlink_twice(self, missing_ok=False):
            calls.append(self)
            if len(calls) > 2:
                raise Crash
            real_unlink(self, missing_ok=missing_ok)

        monkeypatch.setattr(Path, "unlink", unlink_twice)
    else:
        monkeypatch.setattr(
            a.journal.__class__,
            "unlink",
            lambda self, missing_ok=False: (_ for _ in ()).throw(Crash)
            if self.name == "seal-journal.json"
            else real_unlink(self, missing_ok=missing_ok),
        )
    with pytest.raises(Crash):
        a.seal()
    monkeypatch.undo()
    restarted = make_archiver(tmp_path)  # recover() runs here
    restarted.seal()
    keys = archived_records(tmp_path / "spool")
    assert len(keys) == 40
    assert np.array_equal(np.sort(keys[:, 1]), np.arange(40))
    assert not [p for p in (tmp_path / "spool" / ".staging").iterdir()]


def test_segments_left_open_by_a_dead_writer_are_sealed_and_archived(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    write_segment(tmp_path / "logs", make_records(5, pid=31337), pid=31337, sealed=False)
    (tmp_path / "proc" / "4000").mkdir()  # a live writer's open segment stays untouched
    write_segment(tmp_path / "logs", make_records(5, pid=4000), pid=4000, sealed=False)
    entry = make_archiver(tmp_path).seal()
    assert entry is not None
    assert entry.records == 5
    assert [p.name for p in (tmp_path / "logs").iterdir()] == ["testhost-4000-1-0.cilog"]


def test_unusable_segments_are_quarantined_not_archived(tmp_path: Path) -> None:
    segments(tmp_path, n=1)
    (tmp_path / "logs" / "junk.cilog.sealed").write_bytes(os.urandom(600))
    a = make_archiver(tmp_path)
    entry = a.seal()
    assert entry is not None
    assert entry.records == 10
    assert (tmp_path / "state" / "quarantine" / "junk.cilog.sealed").exists()
    assert a.stats.quarantined == 1
    assert a.stats.segments == 1  # the quarantined file is not counted as archived
