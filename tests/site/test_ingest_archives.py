"""Archive ingest: the columnar store, metadata, idempotency, hostile archives, discovery."""

from __future__ import annotations

import os
import tarfile
import time
from pathlib import Path, PurePosixPath

import pytest
from django.test import Client

from apps.workloads import ingest
from apps.workloads.discovery import discover_archives
from apps.workloads.models import Archive, ArchiveState, SystemSettings, Workload
from apps.workloads.uploads import archive_register
from comminsight_site.objectstore import object_store
from tests.site.archives import (
    manifest_entry,
    manifest_for,
    regular,
    segment_bytes,
    sha256_of,
    tar_zst,
    valid_archive,
)
from tests.site.conftest import stored_objects

pytestmark = pytest.mark.usefixtures("each_storage_backend")


def register(path: Path, owner) -> Archive:
    archive, _ = archive_register(
        source_path=path, sha256=sha256_of(path), size=path.stat().st_size, owner=owner, filename=path.name
    )
    return archive


def store_files(data_dir: Path) -> list[str]:
    return stored_objects(data_dir)


def test_ingest_writes_parquet_per_rank_and_the_workload_metadata(personas, tmp_path, data_dir):
    archive = register(valid_archive(tmp_path, ranks=(2, 3)), personas.alice)
    assert ingest.archive_ingest(archive.pk) == ArchiveState.INGESTED
    workload = Workload.objects.get(owner=personas.alice, external_id="job-7")
    files = ingest.workload_parquet_files(workload)
    assert [PurePosixPath(f).parent.name for f in files] == ["rank-2", "rank-3"]
    assert all(PurePosixPath(f).parent.parent.name == "node-10.0.0.1" for f in files)
    table = object_store().dataset(files[:1]).to_table()
    assert table.num_rows == 8
    assert set(table.column("op").to_pylist()) == {"all_reduce"}
    node = workload.nodes.get()
    assert (node.host, node.node_ip) == ("gpu-host-a", "10.0.0.1")
    assert sorted(workload.ranks.values_list("rank", flat=True)) == [2, 3]
    comm = workload.communicators.get()
    assert (comm.comm_name, comm.nranks, comm.ranks) == ("dp", 4, [2, 3])
    archive.refresh_from_db()
    assert (archive.workload, archive.record_count, archive.node) == (workload, 16, "10.0.0.1")
    assert (workload.first_ns, workload.last_ns) == (10_000, 20_000)


def test_a_second_node_adds_its_ranks_and_extends_communicator_members(personas, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = register(valid_archive(tmp_path / "a", ranks=(0, 1)), personas.alice)
    second = register(valid_archive(tmp_path / "b", node="10.0.0.2", ranks=(2, 3)), personas.alice)
    ingest.archive_ingest(first.pk)
    ingest.archive_ingest(second.pk)
    workload = Workload.objects.get(external_id="job-7")
    assert list(workload.nodes.values_list("name", flat=True)) == ["10.0.0.1", "10.0.0.2"]
    assert workload.communicators.get().ranks == [0, 1, 2, 3]


def test_ingesting_twice_changes_nothing(personas, tmp_path, data_dir):
    archive = register(valid_archive(tmp_path), personas.alice)
    ingest.archive_ingest(archive.pk)
    before = object_store().infos(store_files(data_dir))
    assert ingest.archive_ingest(archive.pk) == ArchiveState.INGESTED
    assert object_store().infos(store_files(data_dir)) == before


def test_a_worker_dying_mid_ingest_leaves_nothing_and_the_retry_completes(personas, tmp_path, data_dir, monkeypatch):
    archive = register(valid_archive(tmp_path), personas.alice)
    real_publish = ingest._publish

    def die(*args, **kwargs):
        raise OSError("worker killed")

    monkeypatch.setattr(ingest, "_publish", die)
    with pytest.raises(OSError, match="worker killed"):
        ingest.archive_ingest(archive.pk)
    archive.refresh_from_db()
    assert archive.state == ArchiveState.STORED
    assert store_files(data_dir) == []
    # The workload row may exist (it is created before publishing, so no row lock is held meanwhile): empty.
    assert not Workload.objects.filter(external_id="job-7", ranks__isnull=False).exists()
    assert archive.workload is None
    assert "worker killed" in archive.reason
    monkeypatch.setattr(ingest, "_publish", real_publish)
    assert ingest.archive_ingest(archive.pk) == ArchiveState.INGESTED
    assert len(store_files(data_dir)) == 3  # two ranks and one hang file, once each


def hostile(tmp_path: Path, kind: str) -> Path:
    """One hostile archive per ``kind``; each is refused for the reason named in the test table."""
    path = tmp_path / f"ci-evil-{kind}.tar.zst"
    segment = segment_bytes(0)
    good = [("segments/s0.cilog.sealed", segment)]
    manifest = manifest_for()
    if kind == "traversal":
        return tar_zst(path, [manifest_entry(manifest, good), regular("../../etc/cron.d/x", b"boom")])
    if kind == "absolute":
        return tar_zst(path, [manifest_entry(manifest, good), regular("/etc/passwd", b"root")])
    if kind in ("symlink", "hardlink", "device"):
        info = tarfile.TarInfo("segments/s0.cilog.sealed")
        info.type = {"symlink": tarfile.SYMTYPE, "hardlink": tarfile.LNKTYPE, "device": tarfile.CHRTYPE}[kind]
        info.linkname = "/etc/shadow"
        return tar_zst(path, [manifest_entry(manifest, good), info])
    if kind == "bomb":
        zeros = b"\0" * (64 << 20)
        return tar_zst(
            path,
            [
                manifest_entry(manifest, [("segments/s0.cilog.sealed", zeros)]),
                regular("segments/s0.cilog.sealed", zeros),
            ],
        )
    if kind == "truncated":
        full = valid_archive(tmp_path)
        data = full.read_bytes()
        full.unlink()
        path.write_bytes(data[: len(data) // 2])
        return path
    if kind == "lying-size":
        entry = manifest_entry(manifest, [("segments/s0.cilog.sealed", segment + b"x")])
        return tar_zst(path, [entry, regular("segments/s0.cilog.sealed", segment)])
    if kind == "lying-hash":
        entry = manifest_entry(manifest, [("segments/s0.cilog.sealed", segment[:-1] + b"\x01")])
        return tar_zst(path, [entry, regular("segments/s0.cilog.sealed", segment)])
    if kind == "manifest-not-first":
        return tar_zst(path, [regular("segments/s0.cilog.sealed", segment), manifest_entry(manifest, good)])
    if kind == "bad-comm-hash":
        bad = {**manifest, "communicators": [{"comm_hash": "../../x", "nranks": 1, "ranks": [0]}]}
        return tar_zst(path, [manifest_entry(bad, good), regular("segments/s0.cilog.sealed", segment)])
    if kind == "not-an-archive":
        path.write_bytes(b"GET / HTTP/1.1\r\n" * 10)
        return path
    raise AssertionError(kind)


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("traversal", "not allowed"),
        ("absolute", "not allowed"),
        ("symlink", "not a regular file"),
        ("hardlink", "not a regular file"),
        ("device", "not a regular file"),
        ("bomb", "decompression bomb"),
        ("truncated", "tar+zstd archive"),
        ("lying-size", "manifest says"),
        ("lying-hash", "does not match its sha256"),
        ("manifest-not-first", "first member is not manifest.json"),
        ("bad-comm-hash", "comm_hash"),
        ("not-an-archive", "not a readable tar+zstd archive"),
    ],
)
def test_hostile_archive_is_quarantined_with_a_reason_and_nothing_written(personas, tmp_path, data_dir, kind, reason):
    archive = register(hostile(tmp_path, kind), personas.alice)
    assert ingest.archive_ingest(archive.pk) == ArchiveState.QUARANTINED
    archive.refresh_from_db()
    assert reason in archive.reason
    assert store_files(data_dir) == []
    assert not Workload.objects.filter(external_id="job-7").exists()
    assert PurePosixPath(archive.path).parent.name == "quarantine"
    assert not (Path("/etc/cron.d/x")).exists()


def test_quarantined_archive_is_shown_to_its_owner_only(client, personas, tmp_path):
    archive = register(hostile(tmp_path, "symlink"), personas.alice)
    ingest.archive_ingest(archive.pk)
    client.force_login(personas.alice)
    assert b"not a regular file" in client.get("/workloads/").content
    client.force_login(personas.carol)
    assert b"not a regular file" not in client.get("/workloads/").content


def shared_archive_dir(root: Path) -> Path:
    path = root / "comminsight" / "02_archives"
    path.mkdir(parents=True)
    return path


def test_discovery_ingests_an_archive_dropped_in_the_path_without_moving_it(
    personas, tmp_path, django_capture_on_commit_callbacks
):
    shared = tmp_path / "shared"
    drop = shared_archive_dir(shared)
    SystemSettings.objects.create(id=1, archive_path=str(shared), discovery_owner=personas.bob)
    (tmp_path / "w").mkdir()
    made = valid_archive(tmp_path / "w")
    dropped = drop / made.name
    made.replace(dropped)
    with django_capture_on_commit_callbacks(execute=True):
        assert discover_archives() == 1
    archive = Archive.objects.get()
    assert (archive.state, archive.owner, archive.path) == (ArchiveState.INGESTED, personas.bob, str(dropped))
    assert dropped.exists()
    workload = Workload.objects.get(external_id="job-7")
    assert workload.owner == personas.bob
    assert discover_archives() == 0
    client = Client()
    client.force_login(personas.bob)
    listing = client.get("/workloads/").content.decode()
    assert "1.1\xa0KB" in listing  # the archive's size
    detail = client.get(f"/workloads/{workload.pk}/").content.decode()
    assert archive.file_mtime.strftime("%Y-%m-%d %H:%M") in detail
    assert "Found in the archive path" in detail


def test_discovery_ignores_symlinks_and_a_missing_path(personas, tmp_path):
    shared = tmp_path / "shared"
    SystemSettings.objects.create(id=1, archive_path=str(shared))
    assert discover_archives() == 0
    drop = shared_archive_dir(shared)
    (tmp_path / "w").mkdir()
    target = valid_archive(tmp_path / "w")
    os.symlink(target, drop / "ci-link.tar.zst")
    assert discover_archives() == 0
    assert not Archive.objects.exists()


def test_system_settings_show_what_the_last_discovery_scan_saw(client, personas, settings, tmp_path, data_dir):
    from django.core.cache import cache

    from apps.workloads.discovery import LAST_SCAN_KEY

    cache.delete(LAST_SCAN_KEY)
    settings.DEFAULT_ARCHIVE_PATH = str(tmp_path / "shared")
    client.force_login(personas.admin)
    assert "No scan has run yet" in client.get("/settings/").content.decode()
    discover_archives()
    page = client.get("/settings/").content.decode()
    assert "0 new, 0 known, 0 skipped" in page
    assert "comminsight/02_archives is not a directory" in page
    drop = tmp_path / "shared" / "comminsight" / "02_archives" / "job-7" / "n1"
    drop.mkdir(parents=True)
    valid_archive(drop)
    discover_archives()
    page = client.get("/settings/").content.decode()
    assert "1 new, 0 known, 0 skipped." in page
    assert "not a directory" not in page


def test_changing_the_archive_path_moves_nothing(client, personas, tmp_path):
    shared = tmp_path / "shared"
    drop = shared_archive_dir(shared)
    (drop / "keep.tar.zst").write_bytes(b"x")
    client.force_login(personas.admin)
    client.post("/settings/", {"archive_path": str(shared)})
    client.post("/settings/", {"archive_path": str(tmp_path / "elsewhere")})
    assert (drop / "keep.tar.zst").read_bytes() == b"x"
    assert SystemSettings.load().archive_path == str(tmp_path / "elsewhere")


def test_settings_refuse_a_relative_archive_path(client, personas):
    client.force_login(personas.root)
    response = client.post("/settings/", {"archive_path": "relative/dir"})
    assert response.status_code == 400
    assert SystemSettings.load().archive_path == ""


def test_discovered_file_is_not_hashed_again_while_unchanged(personas, tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    drop = shared_archive_dir(shared)
    SystemSettings.objects.create(id=1, archive_path=str(shared))
    (tmp_path / "w").mkdir()
    made = valid_archive(tmp_path / "w")
    made.replace(drop / made.name)
    discover_archives()
    from apps.workloads import discovery

    monkeypatch.setattr(discovery, "file_sha256", lambda p: pytest.fail("re-hashed an unchanged file"))
    time.sleep(0)  # no waiting: the mtime is unchanged by construction
    assert discover_archives() == 0


def test_archives_left_waiting_are_queued_again_and_ingested(personas, tmp_path):
    from datetime import timedelta

    from django.utils import timezone

    from apps.workloads.tasks import requeue_stale_archives

    archive = register(valid_archive(tmp_path), personas.alice)  # its task message never ran (db fixture)
    assert requeue_stale_archives() == 0  # too recent to call lost
    Archive.objects.filter(pk=archive.pk).update(created_at=timezone.now() - timedelta(hours=1))
    assert requeue_stale_archives() == 1
    archive.refresh_from_db()
    assert archive.state == ArchiveState.INGESTED


def test_deleting_a_workload_removes_its_store_and_uploaded_archives(
    client, personas, tmp_path, data_dir, django_capture_on_commit_callbacks
):
    archive = register(valid_archive(tmp_path), personas.alice)
    ingest.archive_ingest(archive.pk)
    archive.refresh_from_db()
    stored = archive.path
    assert object_store().exists(stored)
    client.force_login(personas.alice)
    with django_capture_on_commit_callbacks(execute=True):
        response = client.delete(f"/api/v1/workloads/{archive.workload_id}/")
    assert response.status_code == 204
    assert not Archive.objects.filter(pk=archive.pk).exists()
    assert not object_store().exists(stored)
    assert [p for p in store_files(data_dir) if p.endswith(".parquet")] == []


def test_abandoned_uploads_expire_and_free_the_quota(personas):
    from datetime import timedelta

    from django.utils import timezone

    from apps.workloads.models import Upload
    from apps.workloads.uploads import owner_bytes_in_use, part_path, upload_create, uploads_expire

    upload = upload_create(token=personas.agent_token, sha256="ab" * 32, size=5000, filename="a.tar.zst").upload
    assert owner_bytes_in_use(personas.alice) == 5000
    assert uploads_expire() == 0
    Upload.objects.filter(pk=upload.pk).update(updated_at=timezone.now() - timedelta(days=8))
    assert uploads_expire() == 1
    assert not part_path(upload).exists()
    assert owner_bytes_in_use(personas.alice) == 0


def test_ranks_come_from_the_segments_when_the_manifest_lists_none(personas, tmp_path, data_dir):
    """A lab set-up where every rank believes it is its own host (nNodes 2, nranks 2 on one machine): the agent
    sealed both ranks' segments but its manifest lists no ranks. The segments are the truth."""
    from comminsight.formats.archive import ArchiveMember, write_archive

    manifest = manifest_for(ranks=())
    members = [
        ArchiveMember(f"segments/host-{1000 + r}-1000-0.cilog.sealed", data=segment_bytes(r), records=8) for r in (0, 1)
    ]
    path = write_archive(tmp_path / "ci-job-7-10.0.0.1-10000-20000.tar.zst", manifest, members).path
    archive = register(path, personas.alice)
    assert ingest.archive_ingest(archive.pk) == ArchiveState.INGESTED
    workload = Workload.objects.get(owner=personas.alice, external_id="job-7")
    assert sorted(workload.ranks.values_list("rank", flat=True)) == [0, 1]
    assert workload.communicators.get().ranks == [0, 1]


def test_a_manifest_listing_200000_ranks_and_20000_communicators_writes_only_what_the_segments_hold(personas, tmp_path):
    """A cheap manifest must not buy an expensive ingest: rows are bounded by the segments (2 ranks, 1 communicator
    here), whatever the manifest lists; what it says about a communicator the segments hold is kept."""
    from comminsight.formats.archive import ArchiveMember, write_archive

    manifest = manifest_for(ranks=tuple(range(200_000)))
    manifest["communicators"] += [
        {"comm_hash": f"0x{n:016x}", "comm_name": f"c{n}", "nranks": 200_000, "ranks": [n]} for n in range(20_000)
    ]
    manifest["communicators"][0]["positions"] = {"0": 0, "1": 1, "7": 2}
    members = [ArchiveMember(f"segments/s{r}.cilog.sealed", data=segment_bytes(r), records=8) for r in (0, 1)]
    path = write_archive(tmp_path / "ci-job-7-10.0.0.1-1-2.tar.zst", manifest, members).path
    archive = register(path, personas.alice)
    assert ingest.archive_ingest(archive.pk) == ArchiveState.INGESTED
    workload = Workload.objects.get(external_id="job-7")
    assert sorted(workload.ranks.values_list("rank", flat=True)) == [0, 1]
    comm = workload.communicators.get()
    assert (comm.comm_name, comm.nranks, comm.ranks, comm.positions) == ("dp", 4, [0, 1], {"0": 0, "1": 1})


def test_an_archive_whose_segments_hold_many_communicators_writes_them_in_bulk(
    personas, tmp_path, django_assert_max_num_queries
):
    """2,000 communicators in the records: a bounded number of statements, not one per row."""
    import numpy as np

    from comminsight.formats import header
    from comminsight.formats.archive import ArchiveMember, write_archive

    def many_communicators(rank: int) -> bytes:
        data = bytearray(segment_bytes(rank, n=2000))
        size = header.constants()["CI_LOG_HEADER_SIZE"]
        records = np.frombuffer(data, header.record_dtype(), offset=size).copy()
        records["comm_hash"] = np.arange(1, 2001, dtype=np.uint64)
        header.seal_records(records)
        return bytes(data[:size]) + records.tobytes()

    manifest = manifest_for(ranks=(0, 1))
    members = [ArchiveMember(f"segments/s{r}.cilog.sealed", data=many_communicators(r), records=2000) for r in (0, 1)]
    archive = register(write_archive(tmp_path / "ci-many.tar.zst", manifest, members).path, personas.alice)
    with django_assert_max_num_queries(60):
        assert ingest.archive_ingest(archive.pk) == ArchiveState.INGESTED
    workload = Workload.objects.get(external_id="job-7")
    assert workload.communicators.count() == 2000
    assert set(workload.communicators.values_list("nranks", flat=True)) == {2}
    # A second node's archive of the same communicators merges its members into the same rows.
    second = register(
        write_archive(
            tmp_path / "ci-many-2.tar.zst",
            manifest_for(node="10.0.0.2", ranks=(2,)),
            [ArchiveMember("segments/s2.cilog.sealed", data=many_communicators(2), records=2000)],
        ).path,
        personas.alice,
    )
    with django_assert_max_num_queries(60):
        assert ingest.archive_ingest(second.pk) == ArchiveState.INGESTED
    assert set(map(tuple, workload.communicators.values_list("ranks", flat=True))) == {(0, 1, 2)}
