"""Archive format v1: round trip, and hostile archives refused with a clear reason."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest
import zstandard
from pywriter import make_records, write_segment

from comminsight import importers
from comminsight.formats.archive import (
    ArchiveError,
    ArchiveLimits,
    ArchiveMember,
    archive_filename,
    file_sha256,
    read_archive,
    write_archive,
)
from comminsight.importers import EvidenceError

IDENTITY = {"workload_id": "job-1", "node": "10.0.0.7", "host": "h", "node_ip": "10.0.0.7", "created_ns": 1}


def hostile(path: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    """Write an arbitrary tar+zstd (no validation) for hostile-input tests."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    path.write_bytes(zstandard.ZstdCompressor().compress(raw.getvalue()))
    return path


def manifest_for(members: dict[str, bytes]) -> bytes:
    return json.dumps(
        {
            **IDENTITY,
            "schema_version": 1,
            "kind": "comminsight.archive",
            "members": [
                {"name": n, "size": len(d), "sha256": hashlib.sha256(d).hexdigest(), "records": 0}
                for n, d in members.items()
            ],
        }
    ).encode()


def _drain(path: Path, limits: ArchiveLimits | None = None) -> None:
    list(read_archive(path, limits)[1])


def reg(name: str) -> tarfile.TarInfo:
    return tarfile.TarInfo(name)


def test_round_trip_keeps_bytes_manifest_and_identity(tmp_path: Path) -> None:
    seg = write_segment(tmp_path / "logs", make_records(7, pid=5), pid=5, global_rank=2)
    hang = tmp_path / "h.json"
    hang.write_text('{"x": 1}')
    written = write_archive(
        tmp_path / "a.tar.zst",
        {**IDENTITY, "ranks": [2]},
        [ArchiveMember(f"segments/{seg.name}", path=seg, records=7), ArchiveMember("hang/h.json", path=hang)],
    )
    assert written.sha256 == file_sha256(tmp_path / "a.tar.zst")
    manifest, members = read_archive(tmp_path / "a.tar.zst")
    assert manifest["record_count"] == 7
    assert manifest["schema_version"] == 1
    got = dict(members)
    assert got[f"segments/{seg.name}"] == seg.read_bytes()
    assert json.loads(got["hang/h.json"]) == {"x": 1}
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary left behind


def test_archive_filename_is_safe_and_says_what_it_holds() -> None:
    assert archive_filename("job/1", "10.0.0.7", 5, 9) == "ci-job_1-10.0.0.7-5-9.tar.zst"


def test_writer_refuses_a_member_name_outside_the_allow_list(tmp_path: Path) -> None:
    with pytest.raises(ArchiveError, match="not allowed"):
        write_archive(tmp_path / "a.tar.zst", IDENTITY, [ArchiveMember("../etc/passwd", data=b"x")])
    assert not (tmp_path / "a.tar.zst").exists()


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: [(reg("segments/a"), b"x")], "first member is not manifest.json"),
        (lambda: [(reg("manifest.json"), b"{not json")], "not valid JSON"),
        (lambda: [(reg("manifest.json"), b'{"kind": "other"}')], "kind"),
    ],
)
def test_archives_without_a_valid_manifest_are_refused(tmp_path: Path, build, message: str) -> None:
    with pytest.raises(ArchiveError, match=message):
        read_archive(hostile(tmp_path / "x.tar.zst", build()))


def test_path_traversal_and_links_are_refused(tmp_path: Path) -> None:
    payload = {"segments/ok": b"1"}
    for bad_name in ("../../etc/cron.d/x", "/abs/path", "segments/../../x"):
        path = hostile(tmp_path / "t.tar.zst", [(reg("manifest.json"), manifest_for(payload)), (reg(bad_name), b"x")])
        _, members = read_archive(path)
        with pytest.raises(ArchiveError, match="not allowed"):
            list(members)
    link = tarfile.TarInfo("segments/ok")
    link.type = tarfile.SYMTYPE
    link.linkname = "/etc/passwd"
    path = hostile(tmp_path / "l.tar.zst", [(reg("manifest.json"), manifest_for(payload)), (link, b"")])
    _, members = read_archive(path)
    with pytest.raises(ArchiveError, match="not a regular file"):
        list(members)


def test_member_that_does_not_match_its_manifest_sha256_is_refused(tmp_path: Path) -> None:
    path = hostile(
        tmp_path / "x.tar.zst",
        [(reg("manifest.json"), manifest_for({"segments/a": b"good"})), (reg("segments/a"), b"evil")],
    )
    _, members = read_archive(path)
    with pytest.raises(ArchiveError, match="sha256"):
        list(members)


def test_unlisted_and_missing_members_are_refused(tmp_path: Path) -> None:
    path = hostile(tmp_path / "x.tar.zst", [(reg("manifest.json"), manifest_for({})), (reg("segments/b"), b"x")])
    with pytest.raises(ArchiveError, match="not listed"):
        list(read_archive(path)[1])
    path = hostile(tmp_path / "y.tar.zst", [(reg("manifest.json"), manifest_for({"segments/a": b"x"}))])
    with pytest.raises(ArchiveError, match="missing listed members"):
        list(read_archive(path)[1])


def test_too_many_members_are_refused(tmp_path: Path) -> None:
    payload = {f"segments/s{i}": b"x" for i in range(20)}
    path = hostile(
        tmp_path / "x.tar.zst",
        [(reg("manifest.json"), manifest_for(payload))] + [(reg(n), d) for n, d in payload.items()],
    )
    with pytest.raises(ArchiveError, match="more than 5 members"):
        _drain(path, ArchiveLimits(max_members=5))


def test_a_decompression_bomb_is_stopped_by_the_ratio_cap(tmp_path: Path) -> None:
    zeros = b"\0" * (8 << 20)
    path = hostile(
        tmp_path / "bomb.tar.zst",
        [(reg("manifest.json"), manifest_for({"segments/z": zeros})), (reg("segments/z"), zeros)],
    )
    assert path.stat().st_size < 100_000
    with pytest.raises(ArchiveError, match="expands more than"):
        list(read_archive(path, ArchiveLimits(max_ratio=50))[1])


def test_member_over_the_byte_cap_is_refused(tmp_path: Path) -> None:
    data = bytes(range(256)) * 4096
    path = hostile(
        tmp_path / "x.tar.zst", [(reg("manifest.json"), manifest_for({"segments/a": data})), (reg("segments/a"), data)]
    )
    with pytest.raises(ArchiveError, match="larger than"):
        list(read_archive(path, ArchiveLimits(max_member_bytes=1000))[1])


@pytest.mark.parametrize("content", [b"", b"garbage" * 100, b"\x28\xb5\x2f\xfd" + b"\0" * 50])
def test_garbage_and_truncated_files_are_refused(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "g.tar.zst").write_bytes(content)
    with pytest.raises(ArchiveError):
        _drain(tmp_path / "g.tar.zst")


def test_truncated_archive_is_refused(tmp_path: Path) -> None:
    seg = write_segment(tmp_path / "logs", make_records(500, pid=5), pid=5)
    write_archive(tmp_path / "a.tar.zst", IDENTITY, [ArchiveMember(f"segments/{seg.name}", path=seg, records=500)])
    data = (tmp_path / "a.tar.zst").read_bytes()
    (tmp_path / "a.tar.zst").write_bytes(data[: len(data) // 2])
    with pytest.raises(ArchiveError):
        list(read_archive(tmp_path / "a.tar.zst")[1])


def test_archive_importer_turns_an_archive_into_the_operations_table(tmp_path: Path) -> None:
    seg = write_segment(tmp_path / "logs", make_records(9, pid=5, rank=1, nranks=4), pid=5, global_rank=6)
    write_archive(tmp_path / "a.tar.zst", IDENTITY, [ArchiveMember(f"segments/{seg.name}", path=seg, records=9)])
    table = importers.load(tmp_path / "a.tar.zst")
    assert table.num_rows == 9
    assert set(table.column("rank").to_pylist()) == {6}
    assert set(table.column("comm_rank").to_pylist()) == {1}
    assert set(table.column("op").to_pylist()) == {"all_reduce"}
    assert table.column("seq").to_pylist() == list(range(9))


def test_archive_importer_reports_a_corrupt_archive_as_evidence_error(tmp_path: Path) -> None:
    path = hostile(
        tmp_path / "x.tar.zst",
        [(reg("manifest.json"), manifest_for({"segments/a": b"good"})), (reg("segments/a"), b"evil")],
    )
    with pytest.raises(EvidenceError, match="sha256"):
        importers.load(path, fmt="archive")
