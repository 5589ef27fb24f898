"""Browser tests: Playwright driving Debian's Chromium against pytest-django's live server.

Screenshots go to tests/browser/artifacts/ (git-ignored) so a person can look at what the user saw.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).parent / "artifacts"

# Playwright's sync API keeps an event loop running in this thread; the test's own ORM calls are still
# synchronous and safe, so tell Django not to refuse them.
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args: dict) -> dict:
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (`make chromium` installs it)")
    return {
        **browser_type_launch_args,
        "executable_path": CHROMIUM,
        "args": [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
        ],
    }


@pytest.fixture
def data_dir(settings, tmp_path: Path) -> Path:
    path = tmp_path / "data"
    path.mkdir()
    settings.DATA_DIR = path
    settings.BOOTSTRAP_TOKEN_PATH = path / "bootstrap-token"
    return path


@pytest.fixture
def artifacts() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


@pytest.fixture
def celery_eager():
    """Ingest runs inside the live server's request thread (no worker in browser tests)."""
    from comminsight_site.celery import app

    previous = app.conf.CELERY_TASK_ALWAYS_EAGER
    app.conf.CELERY_TASK_ALWAYS_EAGER = True
    yield
    app.conf.CELERY_TASK_ALWAYS_EAGER = previous
