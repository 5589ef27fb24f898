"""Browser tests: Playwright driving Debian's Chromium against pytest-django's live server.

Screenshots go to tests/browser/artifacts/ (git-ignored) so a person can look at what the user saw.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).parent / "artifacts"
PLUGIN = Path(__file__).resolve().parents[2] / "native/profiler/build/libnccl-profiler-comminsight.so"

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


@pytest.fixture
def profiler_plugin() -> Path:
    """The built profiler plugin, which the demo job runs through; the test is skipped without it."""
    if not PLUGIN.exists():
        pytest.skip("profiler plugin not built (make -C native/profiler)")
    return PLUGIN


@pytest.fixture
def sign_in(page, live_server) -> Callable[[str], None]:
    """``sign_in("bob")``: a persona signs in on the live server's page and lands on the workload list."""
    from tests.conftest import PASSWORD

    def sign_in(username: str) -> None:
        page.goto(live_server.url + "/accounts/login/")
        page.fill("#id_username", username)
        page.fill("#id_password", PASSWORD)
        page.click("button[type=submit]")
        page.wait_for_url("**/workloads/")

    return sign_in


@pytest.fixture
def demo_job(live_server, page, personas, data_dir, celery_eager, settings, profiler_plugin):
    """``with demo_job(plan) as workload:`` clicks "Run a demo job" on the open list (root's, signed in by the
    test) and gives the new workload once its page opens; leaving waits for the job to end (up to 4 minutes), so
    what follows reads a finished job and no job outlives the test. The site starts with no workloads, the list
    that offers the demo."""
    from apps.workloads.demo import demo_running
    from apps.workloads.models import Workload

    Workload.objects.all().delete()

    @contextlib.contextmanager
    def run(plan: dict) -> Iterator[Workload]:
        settings.DEMO_PLAN = plan
        page.click("#run-demo")
        try:
            page.wait_for_url("**/workloads/*/")
            yield Workload.objects.get()
        finally:
            deadline = time.monotonic() + 240
            while demo_running() and time.monotonic() < deadline:
                time.sleep(1)

    return run
