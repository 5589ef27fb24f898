"""Shared fixtures for the site's tests: the named personas every suite speaks about.

root (the initialisation account), admin (an administrator), alice (owns a workload), bob (alice's
workload is shared with him, read), carol (nothing shared), anonymous, and an agent token owned by alice.
Fixtures only — importing this file costs nothing for suites that do not use them.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

PASSWORD = "correct horse battery"


@dataclass
class Personas:
    root: object
    admin: object
    alice: object
    bob: object
    carol: object
    workload: object  # alice's, shared with bob (read)
    other_workload: object  # carol's own, shared with nobody
    agent_token: object  # alice's token object
    agent_secret: str  # "ci_<prefix>_<secret>" of alice's token
    carol_agent_secret: str


@pytest.fixture(scope="session")
def persona_password_hash() -> str:
    """Argon2 is slow on purpose: hash the shared persona password once per test session."""
    from django.contrib.auth.hashers import make_password

    return make_password(PASSWORD)


@pytest.fixture
def personas(db, persona_password_hash) -> Personas:
    from apps.accounts.models import Role, User
    from apps.accounts.services import agent_token_create
    from apps.workloads.models import ShareLevel, Workload, WorkloadShare

    def make(name: str, role: str = Role.USER) -> User:
        user = User(username=name, role=role, password=persona_password_hash)
        user.save()
        return user

    root, admin = make("root", Role.ROOT), make("admin", Role.ADMIN)
    alice, bob, carol = make("alice"), make("bob"), make("carol")
    workload = Workload.objects.create(name="llama-pretrain", external_id="job-1", owner=alice)
    WorkloadShare.objects.create(workload=workload, user=bob, level=ShareLevel.READ)
    other = Workload.objects.create(name="carol-finetune", external_id="job-2", owner=carol)
    issued = agent_token_create(owner=alice, name="node-pool-a")
    carol_issued = agent_token_create(owner=carol, name="carol-pool")
    return Personas(root, admin, alice, bob, carol, workload, other, issued.token, issued.secret, carol_issued.secret)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """Run the browser tests last.

    Playwright's sync API keeps an event loop running in the main thread for the rest of the
    session once a browser starts, and Django's async_to_sync (Channels tests) refuses to run
    beside a running loop. After pytest-django's own ordering, move them to the end.
    """
    items.sort(key=lambda item: item.get_closest_marker("browser") is not None)


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory) -> str:
    """A real S3 server: the one `.ci/run` started (COMMINSIGHT_TEST_S3_ENDPOINT), else SeaweedFS for this session."""
    import os

    from tests import s3server

    given = os.environ.get("COMMINSIGHT_TEST_S3_ENDPOINT", "")
    if given:
        yield given
        return
    server = s3server.start(tmp_path_factory.mktemp("seaweedfs"))
    yield server.endpoint
    server.stop()


@pytest.fixture
def s3_storage(settings, s3_endpoint) -> str:
    """Points the site's object store at a prefix of its own in the test bucket; empties it afterwards."""
    import uuid

    from comminsight_site.objectstore import object_store
    from tests import s3server

    url = f"s3://{s3server.BUCKET}/t-{uuid.uuid4().hex[:12]}"
    settings.STORAGE_URL = url
    settings.STORAGE_S3 = {
        "endpoint_url": s3_endpoint,
        "region": "us-east-1",
        "access_key": s3server.ACCESS_KEY,
        "secret_key": s3server.SECRET_KEY,
    }
    yield url
    store = object_store()
    store.filesystem.delete_dir_contents(store.base, missing_dir_ok=True)


PROFILER = Path(__file__).resolve().parents[1] / "native" / "profiler"


@pytest.fixture(scope="session")
def plugin() -> Path:
    """The profiler plugin built from this tree, for jobs the simulator drives through it (rebuilt once a
    session; a failed rebuild, sources mid-edit, keeps the last good build). Skipped where the tree has no
    profiler or it does not build."""
    pytest.importorskip("comminsight.simulator")
    if not (PROFILER / "Makefile").is_file():
        pytest.skip("the profiler plugin is not in this tree")
    built = PROFILER / "build" / "libnccl-profiler-comminsight.so"
    build = subprocess.run(["make", "-s", "-C", str(PROFILER)], capture_output=True, text=True, check=False)
    if build.returncode != 0 and not built.is_file():
        pytest.skip(f"the profiler plugin does not build here: {build.stderr[-400:]}")
    return built


RECORDED_KINETO = Path(__file__).resolve().parent / "data" / "kineto_gpu_lab_8rank"


@pytest.fixture
def recorded_kineto(tmp_path: Path) -> tuple[Path, dict]:
    """The Kineto traces recorded on a real GPU (8 NCCL ranks, one made slow on purpose) copied into a folder of
    their own (without the folder's notes and meta.json beside them, as a user's trace folder holds them), and
    their meta.json (the injected rank: ``ground_truth.slow_rank``). Skipped where the checkout lacks them."""
    import json
    import shutil

    if not (RECORDED_KINETO / "meta.json").is_file():
        pytest.skip("recorded Kineto traces are not in this checkout")
    traces = tmp_path / "traces"
    traces.mkdir()
    for path in RECORDED_KINETO.glob("*.pt.trace.json.gz"):
        shutil.copy(path, traces / path.name)
    return traces, json.loads((RECORDED_KINETO / "meta.json").read_text())
