"""Spool and upload client against a real HTTP server speaking upload protocol v1."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
from pywriter import make_records, write_segment
from siteserver import SiteServer

from comminsight.agent.config import load_config
from comminsight.agent.providers import FilesystemProvider, RetryLater, SpoolEntry
from comminsight.agent.spool import Spool
from comminsight.agent.uploader import SiteProvider
from comminsight.formats.archive import ArchiveMember, file_sha256, write_archive


def spooled(tmp_path: Path, spool_dir: Path, n_records: int, index: int = 0) -> SpoolEntry:
    seg = write_segment(
        tmp_path / "logs", make_records(n_records, pid=9, first_record_seq=index * 1000), pid=9, index=index
    )
    spool_dir.mkdir(parents=True, exist_ok=True)
    written = write_archive(
        spool_dir / f"ci-job-n-{index}-{index}.tar.zst",
        {"workload_id": "job", "node": "n"},
        [ArchiveMember(f"segments/{seg.name}", path=seg, records=n_records)],
    )
    return SpoolEntry(
        path=written.path,
        sha256=written.sha256,
        size=written.size,
        created_ns=time.time_ns(),
        records=n_records,
        workload_id="job",
        node="n",
        pending=["site"],
    )


def provider(site: SiteServer, tmp_path: Path, chunk: str = "16K") -> SiteProvider:
    config = load_config(
        env={
            "COMMINSIGHT_AGENT_SERVER_URL": site.url,
            "COMMINSIGHT_AGENT_TOKEN": "test-token",
            "COMMINSIGHT_AGENT_UPLOAD_CHUNK": chunk,
        },
        home=tmp_path,
    )
    return SiteProvider(config)


def test_upload_is_chunked_and_the_site_stores_exactly_the_archive(site: SiteServer, tmp_path: Path) -> None:
    entry = spooled(tmp_path, tmp_path / "spool", 400)
    assert entry.size > 3 * 1024
    provider(site, tmp_path, chunk="1K").deliver(entry)
    assert site.state.archives[entry.sha256] == entry.path.read_bytes()
    assert sum(1 for method, _ in site.state.requests if method == "PATCH") > 2


def test_resending_a_known_archive_is_a_no_op_success(site: SiteServer, tmp_path: Path) -> None:
    entry = spooled(tmp_path, tmp_path / "spool", 10)
    p = provider(site, tmp_path)
    p.deliver(entry)
    before = len(site.state.requests)
    p.deliver(entry)
    assert len(site.state.requests) == before + 1  # one create answered "complete"


def test_a_lost_chunk_ack_resumes_at_the_site_offset(site: SiteServer, tmp_path: Path) -> None:
    entry = spooled(tmp_path, tmp_path / "spool", 400)
    site.state.drop_first_ack = True
    p = provider(site, tmp_path, chunk="1K")
    with pytest.raises(RetryLater):
        p.deliver(entry)
    p.deliver(entry)  # resumes the open upload: the server answers with its offset
    assert site.state.archives[entry.sha256] == entry.path.read_bytes()


def test_busy_site_gives_retry_after_to_the_spool(site: SiteServer, tmp_path: Path) -> None:
    entry = spooled(tmp_path, tmp_path / "spool", 10)
    site.state.down_with = 429
    site.state.retry_after = "7"
    with pytest.raises(RetryLater) as info:
        provider(site, tmp_path).deliver(entry)
    assert info.value.after_s == 7.0


def test_wrong_token_is_not_delivered(site: SiteServer, tmp_path: Path) -> None:
    entry = spooled(tmp_path, tmp_path / "spool", 10)
    config = load_config(
        env={"COMMINSIGHT_AGENT_SERVER_URL": site.url, "COMMINSIGHT_AGENT_TOKEN": "nope"}, home=tmp_path
    )
    with pytest.raises(RetryLater, match="token"):
        SiteProvider(config).deliver(entry)
    assert not site.state.archives


def test_spool_keeps_an_archive_until_the_site_confirms_and_honours_retry_after(
    site: SiteServer, tmp_path: Path
) -> None:
    entry = spooled(tmp_path, tmp_path / "spool", 50)
    spool = Spool(
        tmp_path / "spool",
        [provider(site, tmp_path)],
        max_bytes=1 << 30,
        max_age_s=3600,
        backoff_initial=0.01,
        backoff_max=0.05,
    )
    spool.save(entry)
    site.state.down_with = 503
    site.state.retry_after = "30"
    assert spool.deliver_once() == 0
    assert entry.path.exists()
    assert spool.next_wait(60) > 20  # waits as told, not the short exponential backoff
    site.state.down_with = None
    spool._next_try.clear()
    assert spool.deliver_once() == 1
    assert not entry.path.exists()
    assert entry.sha256 in site.state.archives


def test_full_spool_drops_the_oldest_with_a_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    spool = Spool(tmp_path / "spool", [], max_bytes=1, max_age_s=3600)
    entries = [spooled(tmp_path, tmp_path / "spool", 10, index=i) for i in range(3)]
    for e in entries:
        spool.save(e)
    spool.max_bytes = entries[2].size + entries[1].size
    with caplog.at_level(logging.ERROR):
        spool.enforce_caps()
    assert not entries[0].path.exists()
    assert entries[1].path.exists()
    assert entries[2].path.exists()
    assert spool.stats.dropped_archives == 1
    assert spool.stats.dropped_records == 10
    assert "dropping archive" in caplog.text
    assert entries[0].name in caplog.text


def test_filesystem_provider_never_shows_a_partial_archive(tmp_path: Path) -> None:
    entry = spooled(tmp_path, tmp_path / "spool", 10)
    fs = FilesystemProvider(tmp_path / "mount", "job/1", "10.0.0.7")
    fs.deliver(entry)
    fs.deliver(entry)  # idempotent
    files = list((tmp_path / "mount").rglob("*"))
    final = tmp_path / "mount" / "job_1" / "10.0.0.7" / entry.name
    assert final.is_file()
    assert file_sha256(final) == entry.sha256
    assert not [f for f in files if f.name.startswith(".")]


def test_filesystem_provider_failure_is_retryable(tmp_path: Path) -> None:
    entry = spooled(tmp_path, tmp_path / "spool", 10)
    (tmp_path / "blocker").write_text("a file where a directory should be")
    with pytest.raises(RetryLater):
        FilesystemProvider(tmp_path / "blocker", "job", "n").deliver(entry)
