"""Site test fixtures: every test gets its own data directory (bootstrap token file, uploads, Parquet)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def data_dir(settings, tmp_path: Path) -> Path:
    path = tmp_path / "data"
    path.mkdir()
    settings.DATA_DIR = path
    settings.BOOTSTRAP_TOKEN_PATH = path / "bootstrap-token"
    return path


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
