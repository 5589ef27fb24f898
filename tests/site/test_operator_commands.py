"""Operator commands: archive_scan, import_evidence and purge, run through call_command on a tmp data dir."""

from __future__ import annotations

import re
import shutil
from datetime import timedelta
from io import StringIO
from pathlib import Path, PurePosixPath

import pyarrow.parquet as pq
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

from apps.analysis.models import AnalysisJob, JobState
from apps.analysis.services import analysis_request
from apps.workloads import ingest
from apps.workloads.models import Archive, ArchiveState, Rank, SystemSettings, Workload
from comminsight_site.objectstore import object_store
from tests.site.archives import valid_archive
from tests.site.conftest import stored_objects

FR_PUBLIC = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "public" / "flight_recorder_nvrx"


def run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out, stderr=StringIO())
    return out.getvalue()


def store_files(data_dir: Path) -> list[str]:
    return stored_objects(data_dir)


def database_state() -> tuple:
    return (
        sorted(Workload.objects.values_list("pk", "external_id", "owner__username")),
        sorted(Rank.objects.values_list("workload_id", "rank")),
    )


@pytest.fixture
def gpu_error_1st(tmp_path: Path) -> Path:
    source = FR_PUBLIC / "gpu_error_1st"
    if not source.exists():
        pytest.skip(f"public data {source} not available")
    target = shutil.copytree(source, tmp_path / "gpu_error_1st")
    for path in target.iterdir():
        path.chmod(0o644)
    return target


def reference_missing_ranks() -> list[int]:
    """The answer key shipped with the data: second line, sixth field lists the missing ranks."""
    fields = (FR_PUBLIC / "gpu_error_1st_reference.txt").read_text().splitlines()[1].split("|")
    return [int(r) for r in re.findall(r"\d+", fields[5])]


# --- archive_scan ------------------------------------------------------------------------------------------------


def test_archive_scan_registers_and_ingests_an_archive_dropped_in_the_path(
    personas, tmp_path, django_capture_on_commit_callbacks
):
    shared = tmp_path / "shared"
    drop = shared / "comminsight" / "02_archives"
    drop.mkdir(parents=True)
    SystemSettings.objects.create(id=1, archive_path=str(shared), discovery_owner=personas.bob)
    (tmp_path / "w").mkdir()
    dropped = valid_archive(tmp_path / "w").replace(drop / "job-7.tar.zst")
    with django_capture_on_commit_callbacks(execute=True):
        output = run("archive_scan")
    assert f"queued   {dropped}" in output
    assert "found 1: 1 queued for ingest, 0 already registered, 0 skipped" in output
    archive = Archive.objects.get()
    assert (archive.state, archive.owner) == (ArchiveState.INGESTED, personas.bob)
    assert dropped.exists()
    again = run("archive_scan")
    assert "found 1: 0 queued for ingest, 1 already registered" in again


def test_archive_scan_with_a_path_scans_there_and_leaves_the_setting_alone(personas, tmp_path):
    drop = tmp_path / "elsewhere" / "comminsight" / "02_archives"
    drop.mkdir(parents=True)
    (drop / "broken.tar.zst").symlink_to(tmp_path / "nowhere")
    output = run("archive_scan", "--path", str(tmp_path / "elsewhere"))
    assert "skipped" in output
    assert "not a regular file" in output
    assert SystemSettings.load().archive_path == ""
    assert not Archive.objects.exists()


def test_archive_scan_without_a_path_fails_saying_why(personas, settings):
    settings.DEFAULT_ARCHIVE_PATH = ""
    with pytest.raises(CommandError, match="no archive path"):
        run("archive_scan")


def test_archive_scan_with_a_missing_default_directory_fails_naming_it(personas, settings, tmp_path):
    settings.DEFAULT_ARCHIVE_PATH = str(tmp_path / "nothing-here")
    with pytest.raises(CommandError, match="nothing-here/comminsight/02_archives is not a directory"):
        run("archive_scan")


# --- import_evidence ---------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("each_storage_backend")
def test_imported_flight_recorder_dumps_make_a_workload_whose_hang_analysis_finds_the_missing_rank(
    personas, gpu_error_1st, data_dir, django_capture_on_commit_callbacks
):
    output = run("import_evidence", str(gpu_error_1st), "--workload", "fr-job", "--owner", "alice")
    workload = Workload.objects.get(external_id="fr-job")
    assert f"created workload {workload.pk}" in output
    assert workload.owner == personas.alice
    assert sorted(workload.ranks.values_list("rank", flat=True)) == list(range(16))
    assert workload.communicators.exists()
    files = ingest.workload_parquet_files(workload)
    assert len(files) == 16
    assert all(PurePosixPath(f).name.startswith("import-") for f in files)
    assert not any((data_dir / "store" / ".staging").iterdir())
    with django_capture_on_commit_callbacks(execute=True):
        analysis_request(workload, "hang", None, {})
    job = AnalysisJob.objects.get(workload=workload, kind="hang")
    assert job.state == JobState.DONE, job.error
    first = job.result["stuck_groups"][0]
    assert first["missing_ranks"] == reference_missing_ranks()
    assert 12 in first["missing_ranks"]


def test_importing_the_same_evidence_again_replaces_its_own_files(personas, gpu_error_1st, data_dir):
    run("import_evidence", str(gpu_error_1st), "--workload", "fr-job", "--owner", "alice")
    before = store_files(data_dir)
    output = run("import_evidence", str(gpu_error_1st), "--workload", "fr-job", "--owner", "alice")
    assert "added to workload" in output
    assert store_files(data_dir) == before
    assert sum(pq.read_metadata(f).num_rows for f in before) == int(re.search(r"(\d+) operations", output)[1])


@pytest.mark.parametrize(
    "content",
    [b"", b"not evidence at all\n" * 10, b"\x80\x04\x95" + b"\xff" * 64, b"rank,op\n" + b"x" * 4096],
    ids=["empty", "text", "truncated-pickle", "garbage-csv"],
)
def test_importing_a_malformed_file_changes_nothing_and_fails(personas, tmp_path, data_dir, content):
    bad = tmp_path / "evidence.bin"
    bad.write_bytes(content)
    before = (database_state(), store_files(data_dir))
    with pytest.raises(CommandError, match=r"evidence\.bin"):
        run("import_evidence", str(bad), "--workload", "new-job", "--owner", "alice")
    assert (database_state(), store_files(data_dir)) == before


def test_importing_with_a_forced_format_that_does_not_fit_changes_nothing(personas, gpu_error_1st, data_dir):
    before = (database_state(), store_files(data_dir))
    with pytest.raises(CommandError):
        run("import_evidence", str(gpu_error_1st), "--workload", "job-1", "--owner", "alice", "--format", "kineto")
    with pytest.raises(CommandError, match="unknown format"):
        run("import_evidence", str(gpu_error_1st), "--workload", "job-1", "--owner", "alice", "--format", "nope")
    assert (database_state(), store_files(data_dir)) == before


def test_a_missing_path_or_unknown_owner_is_refused(personas, tmp_path):
    with pytest.raises(CommandError, match="no such file"):
        run("import_evidence", str(tmp_path / "absent"), "--workload", "x", "--owner", "alice")
    with pytest.raises(CommandError, match="no user named"):
        run("import_evidence", str(tmp_path), "--workload", "x", "--owner", "mallory")


def test_importing_into_another_owners_workload_is_refused(personas, gpu_error_1st, data_dir):
    before = (database_state(), store_files(data_dir))
    with pytest.raises(CommandError, match="belongs to another user"):
        run(
            "import_evidence", str(gpu_error_1st), "--workload", personas.other_workload.external_id, "--owner", "alice"
        )
    assert (database_state(), store_files(data_dir)) == before


def test_a_failure_while_publishing_leaves_no_rows_and_no_staging(personas, gpu_error_1st, data_dir, monkeypatch):
    from apps.workloads import services

    def broken(*args, **kwargs):
        raise RuntimeError("database went away")

    monkeypatch.setattr(services, "_node_facts", broken, raising=True)
    before = (database_state(), store_files(data_dir))
    with pytest.raises(RuntimeError):
        run("import_evidence", str(gpu_error_1st), "--workload", "fr-job", "--owner", "alice")
    assert (database_state(), store_files(data_dir)) == before


def test_an_evidence_directory_over_the_file_cap_is_refused_without_changes(
    personas, gpu_error_1st, data_dir, monkeypatch
):
    from apps.workloads import services

    monkeypatch.setattr(services, "MAX_IMPORT_FILES", 3)
    before = (database_state(), store_files(data_dir))
    with pytest.raises(CommandError, match="more than 3 files"):
        run("import_evidence", str(gpu_error_1st), "--workload", "fr-job", "--owner", "alice")
    assert (database_state(), store_files(data_dir)) == before


# --- purge -------------------------------------------------------------------------------------------------------


@pytest.fixture
def imported(personas, gpu_error_1st) -> Workload:
    run("import_evidence", str(gpu_error_1st), "--workload", "fr-job", "--owner", "alice")
    return Workload.objects.get(external_id="fr-job")


def test_purge_dry_run_lists_the_workload_and_deletes_nothing(imported, data_dir):
    before = (database_state(), store_files(data_dir))
    output = run("purge", "--workload", str(imported.pk), "--dry-run")
    assert f"would delete workload {imported.pk} 'fr-job'" in output
    assert (database_state(), store_files(data_dir)) == before


def test_purge_without_yes_refuses_and_deletes_nothing(imported, data_dir):
    before = (database_state(), store_files(data_dir))
    with pytest.raises(CommandError, match="--yes"):
        run("purge", "--workload", str(imported.pk))
    assert (database_state(), store_files(data_dir)) == before


@pytest.mark.usefixtures("each_storage_backend")
def test_purge_yes_removes_the_rows_and_the_store_directory(
    imported, personas, data_dir, django_capture_on_commit_callbacks
):
    assert ingest.workload_parquet_files(imported)
    with django_capture_on_commit_callbacks(execute=True):
        output = run("purge", "--workload", str(imported.pk), "--yes")
    assert f"deleted workload {imported.pk}" in output
    assert not Workload.objects.filter(pk=imported.pk).exists()
    assert not Rank.objects.filter(workload_id=imported.pk).exists()
    assert not object_store().list(ingest.store_prefix(imported.pk))
    assert Workload.objects.filter(pk=personas.workload.pk).exists()


def test_purge_by_age_selects_only_idle_workloads(personas, data_dir, django_capture_on_commit_callbacks):
    old = timezone.now() - timedelta(days=40)
    Workload.objects.filter(pk=personas.other_workload.pk).update(updated_at=old, created_at=old, last_seen_at=old)
    output = run("purge", "--older-than", "30", "--dry-run")
    assert f"would delete workload {personas.other_workload.pk}" in output
    assert f"workload {personas.workload.pk} " not in output
    with django_capture_on_commit_callbacks(execute=True):
        run("purge", "--older-than", "30", "--yes")
    assert list(Workload.objects.values_list("pk", flat=True)) == [personas.workload.pk]


def test_purge_of_an_unknown_id_or_without_a_selector_is_refused(personas):
    with pytest.raises(CommandError, match="No workload with id 999999"):
        run("purge", "--workload", "999999", "--yes")
    with pytest.raises(CommandError):
        run("purge", "--yes")
    with pytest.raises(CommandError, match="between 0"):
        run("purge", "--older-than", "-1", "--yes")
    assert Workload.objects.count() == 2
