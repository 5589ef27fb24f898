"""Site test fixtures: every test gets its own data directory (bootstrap token file, uploads, Parquet); clients
for the personas who call the API."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from django.test import Client


@pytest.fixture(autouse=True)
def data_dir(settings, tmp_path: Path) -> Path:
    path = tmp_path / "data"
    path.mkdir()
    settings.DATA_DIR = path
    settings.BOOTSTRAP_TOKEN_PATH = path / "bootstrap-token"
    return path


@pytest.fixture
def alice(personas) -> Client:
    """Alice signed in, as the pages' own API calls are."""
    client = Client()
    client.force_login(personas.alice)
    return client


@pytest.fixture
def agent(personas) -> Client:
    """Alice's node agent: her agent token as a bearer."""
    return Client(HTTP_AUTHORIZATION=f"Bearer {personas.agent_secret}")


@pytest.fixture(autouse=True)
def celery_eager(request):
    """Tasks run in the test's process unless a test asks for the real worker (``real_celery_worker``)."""
    from comminsight_site.celery import app

    if "real_celery_worker" in request.fixturenames:
        yield
        return
    # The app reads settings under the CELERY_ namespace: override the namespaced keys.
    previous = app.conf.CELERY_TASK_ALWAYS_EAGER, app.conf.CELERY_TASK_EAGER_PROPAGATES
    app.conf.CELERY_TASK_ALWAYS_EAGER = True
    app.conf.CELERY_TASK_EAGER_PROPAGATES = True
    yield
    app.conf.CELERY_TASK_ALWAYS_EAGER, app.conf.CELERY_TASK_EAGER_PROPAGATES = previous


@pytest.fixture(scope="session")
def _session_celery_worker(django_db_setup, django_db_blocker):
    """One real Celery worker (a thread of this process, solo pool) for the whole session.

    Started once: a second in-process worker in the same process stops taking tasks, so every test
    that needs a real worker shares this one. It consumes a queue private to this test run, so other
    suites' workers on the same Redis never take these tasks.
    """
    from celery.contrib.testing.worker import start_worker
    from django.conf import settings
    from django.db import connections

    from comminsight_site.celery import app

    if not settings.REDIS_URL:
        pytest.skip("REDIS_URL is not set: no broker for a real worker")
    queue = f"comminsight-test-{os.getpid()}"
    saved = app.conf.CELERY_TASK_DEFAULT_QUEUE
    app.conf.CELERY_TASK_DEFAULT_QUEUE = queue
    with (
        django_db_blocker.unblock(),
        start_worker(app, pool="solo", concurrency=1, perform_ping_check=False, queues=[queue], shutdown_timeout=30),
    ):
        yield app
    app.conf.CELERY_TASK_DEFAULT_QUEUE = saved
    connections.close_all()


@pytest.fixture
def real_celery_worker(_session_celery_worker):
    """The session's real worker, with tasks published to it instead of run eagerly."""
    app = _session_celery_worker
    saved = app.conf.CELERY_TASK_ALWAYS_EAGER
    app.conf.CELERY_TASK_ALWAYS_EAGER = False
    yield app
    app.conf.CELERY_TASK_ALWAYS_EAGER = saved


@pytest.fixture(params=["local", "s3"])
def each_storage_backend(request, settings) -> str:
    """Runs a test once on the local data directory and once on a real S3 server (SeaweedFS)."""
    if request.param == "s3":
        request.getfixturevalue("s3_storage")
    else:
        settings.STORAGE_URL = ""
    return request.param


def stored_objects(data_dir: Path) -> list[str]:
    """Everything under the store: its objects wherever they live, plus this host's staging files."""
    from comminsight_site.objectstore import object_store

    store = object_store()
    local = data_dir / "store"
    found = [str(p) for p in local.rglob("*") if p.is_file()] if local.exists() else []
    if store.remote:
        found += store.list("store")
    return sorted(set(found))
