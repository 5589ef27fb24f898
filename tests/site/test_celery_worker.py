"""Ingest through a real Celery worker (in this process, against Redis; not eager mode).

Marked slow. Needs REDIS_URL (``make test`` sets it). The worker consumes a queue private to this
test run, so other suites' workers on the same Redis never take these tasks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.db import connection
from django.test import Client
from django.urls import reverse

from apps.workloads import ingest
from apps.workloads.models import Archive, ArchiveState, Workload
from tests.site.archives import sha256_of, valid_archive

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
ROOT = Path(__file__).resolve().parents[2]


def wait_for_state(archive_id: int, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = Archive.objects.get(pk=archive_id).state
        if state != ArchiveState.STORED:
            return state
        time.sleep(0.2)
    return ArchiveState.STORED


def test_uploaded_archive_is_ingested_by_a_real_worker_after_a_retry(
    real_celery_worker, personas, tmp_path, monkeypatch
):
    calls = {"n": 0}
    real_publish = ingest._publish

    def dies_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError("disk went away (the first attempt dies mid-ingest)")
        return real_publish(*args, **kwargs)

    monkeypatch.setattr(ingest, "_publish", dies_once)
    path = valid_archive(tmp_path)
    client = Client(HTTP_AUTHORIZATION=f"Bearer {personas.agent_secret}")
    with path.open("rb") as handle:
        response = client.post(reverse("api-ingest-archives"), {"file": handle, "sha256": sha256_of(path)})
    assert response.status_code == 201
    archive_id = response.json()["archive_id"]
    assert wait_for_state(archive_id) == ArchiveState.INGESTED
    assert calls["n"] == 2
    workload = Workload.objects.get(external_id="job-7", owner=personas.alice)
    assert len(ingest.workload_parquet_files(workload)) == 2
    assert workload.communicators.get().ranks == [0, 1]


def start_worker_process(queue: str, data_dir, settings, lease_s: float = 45.0) -> subprocess.Popen:
    """A worker process (solo pool: one process, so SIGKILL ends the ingest too) with its beat (-B): the
    periodic requeue runs every half lease, as in production."""
    db = connection.settings_dict
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env.update(
        DJANGO_SETTINGS_MODULE="comminsight_site.settings",
        DATABASE_URL=f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        REDIS_URL=settings.REDIS_URL,
        COMMINSIGHT_SERVER_DATA_DIR=str(data_dir),
        CELERY_QUEUE=queue,
        LOG_LEVEL="WARNING",
        COMMINSIGHT_STORAGE_URL="",
        COMMINSIGHT_INGEST_LEASE_S=str(lease_s),
    )
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "comminsight_site",
        "worker",
        "-P",
        "solo",
        "-Q",
        queue,
        "-B",
        "-s",
        str(Path(data_dir) / f"beat-{time.monotonic_ns()}"),
        "-l",
        "warning",
    ]
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_a_worker_killed_mid_ingest_leaves_nothing_and_a_restarted_worker_ingests_it_exactly_once(
    personas, tmp_path, data_dir, settings
):
    """SIGKILL mid-ingest: the killed attempt's lease runs out and the restarted worker's own periodic requeue
    hands the archive to it — no operator, no 40-minute broker visibility timeout. The production lease is
    45 s (ingested about a minute after the restart); here 6 s, with a two-minute deadline for margin."""
    if not settings.REDIS_URL or connection.vendor != "postgresql":
        pytest.skip("needs PostgreSQL and Redis shared with a worker process")
    from apps.workloads.tasks import ingest_archive
    from comminsight_site.celery import app

    path = valid_archive(tmp_path, ranks=tuple(range(8)), records=40_000)  # ~80 MB of records: seconds to ingest
    # The row only (no task queued yet): the test sends the task itself, to the worker it controls.
    archive = Archive.objects.create(
        sha256=sha256_of(path), size=path.stat().st_size, filename=path.name, owner=personas.alice, path=str(path)
    )
    queue = f"comminsight-kill-{os.getpid()}"
    staging = ingest.staging_dir(archive)
    worker = start_worker_process(queue, data_dir, settings, lease_s=6)
    saved = app.conf.CELERY_TASK_ALWAYS_EAGER
    app.conf.CELERY_TASK_ALWAYS_EAGER = False
    try:
        ingest_archive.apply_async(args=[archive.pk], queue=queue)
        deadline = time.monotonic() + 60
        while not staging.exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert staging.exists(), "the worker never started the ingest"
        os.kill(worker.pid, signal.SIGKILL)  # mid-ingest: no chance to clean up or to give the lease back
        worker.wait(timeout=30)
        archive.refresh_from_db()
        assert (archive.state, archive.attempts) == (ArchiveState.STORED, 1)
        assert archive.lease_owner  # the dead attempt's lease, left to run out
        assert not list((data_dir / "store").glob("workload-*/**/*.parquet"))

        worker = start_worker_process(queue, data_dir, settings, lease_s=6)
        assert wait_for_state(archive.pk, timeout_s=120) == ArchiveState.INGESTED
    finally:
        app.conf.CELERY_TASK_ALWAYS_EAGER = saved
        worker.terminate()  # a warm shutdown: a task still running (a duplicate finding it ingested) finishes
        try:
            worker.wait(timeout=60)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait(timeout=30)
    archive.refresh_from_db()
    assert archive.attempts == 2  # the killed one and the one that finished: exactly once
    workload = Workload.objects.get(external_id="job-7", owner=personas.alice)
    files = ingest.workload_parquet_files(workload)
    assert len(files) == 8  # one per rank: the killed attempt left no duplicate
    assert sorted(workload.ranks.values_list("rank", flat=True)) == list(range(8))
    assert not staging.exists()
