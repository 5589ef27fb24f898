"""Ingest through a real Celery worker (in this process, against Redis; not eager mode).

Marked slow. Needs REDIS_URL (``make test`` sets it). The worker consumes a queue private to this
test run, so other suites' workers on the same Redis never take these tasks.
"""

from __future__ import annotations

import os
import time

import pytest
from django.db import connection
from django.test import Client
from django.urls import reverse

from apps.workloads import ingest
from apps.workloads.models import Archive, ArchiveState, Workload
from tests.site.archives import sha256_of, valid_archive

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def real_celery_worker(settings):
    if not settings.REDIS_URL:
        pytest.skip("REDIS_URL is not set: no broker for a real worker")
    from celery.contrib.testing.worker import start_worker

    from comminsight_site.celery import app

    queue = f"comminsight-test-{os.getpid()}"
    saved = app.conf.CELERY_TASK_ALWAYS_EAGER, app.conf.CELERY_TASK_DEFAULT_QUEUE
    app.conf.CELERY_TASK_ALWAYS_EAGER = False
    app.conf.CELERY_TASK_DEFAULT_QUEUE = queue
    with start_worker(app, pool="solo", concurrency=1, perform_ping_check=False, queues=[queue], shutdown_timeout=30):
        yield app
    app.conf.CELERY_TASK_ALWAYS_EAGER, app.conf.CELERY_TASK_DEFAULT_QUEUE = saved
    connection.close()


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
