"""Several hosts: two site processes and two Celery workers that share only PostgreSQL, Redis and S3.

Each process gets a data directory of its own (as a separate host would have); they share the
test database, a Redis database (broker, channel layer, cache), the S3 server (SeaweedFS) under a
prefix of this test, and a Celery queue private to it. Archives are uploaded through both sites,
ingested by whichever worker takes them, analysed by requests to either site (the chord's map
tasks spread over both workers), and the results read back through the other site are identical.
Marked slow: five processes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from django.db import connection

from apps.analysis.models import AnalysisJob
from apps.workloads.models import Archive, ArchiveState, Workload
from tests import s3server
from tests.conftest import PASSWORD
from tests.site.archives import sha256_of, valid_archive
from tests.site.test_partitioned_runs import whole_table_result
from tests.site.test_serve import free_port

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
ROOT = Path(__file__).resolve().parents[2]


def shared_environment(settings, s3_endpoint: str, queue: str, prefix: str) -> dict[str, str]:
    """What every host of the deployment gets alike (docs/operators.md, "Object storage and several hosts")."""
    db = connection.settings_dict
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMMINSIGHT_", "AWS_", "DJANGO_"))}
    env.update(
        DJANGO_SETTINGS_MODULE="comminsight_site.settings",
        DATABASE_URL=f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        REDIS_URL=settings.REDIS_URL,
        SECRET_KEY="several-hosts-test-secret-key-of-enough-length-0123456789",
        COMMINSIGHT_STORAGE_URL=f"s3://{s3server.BUCKET}/{prefix}",
        AWS_ACCESS_KEY_ID=s3server.ACCESS_KEY,
        AWS_SECRET_ACCESS_KEY=s3server.SECRET_KEY,
        AWS_REGION="us-east-1",
        AWS_ENDPOINT_URL=s3_endpoint,
        CELERY_QUEUE=queue,
        COMMINSIGHT_ANALYSIS_PARTITION_ROWS="8",  # one rank per map task: the chord spreads over both workers
        COMMINSIGHT_DB_POOL="0",
    )
    return env


class Host:
    """One host: a site process (Daphne through `manage.py serve`) or a Celery worker, with its own data dir."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], tmp_path: Path, port: int | None = None):
        self.data_dir = tmp_path / name
        self.data_dir.mkdir()
        self.log = tmp_path / f"{name}.log"
        self.port = port
        env = {**env, "COMMINSIGHT_SERVER_DATA_DIR": str(self.data_dir)}
        if port is not None:
            env["COMMINSIGHT_SERVER_LISTEN"] = f"127.0.0.1:{port}"
        with self.log.open("w") as out:
            self.process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_until_serving(self) -> None:
        for _ in range(300):
            assert self.process.poll() is None, self.log.read_text()[-2000:]
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"{self.url} never answered: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)


def site(name: str, env: dict[str, str], tmp_path: Path) -> Host:
    return Host(name, [sys.executable, "manage.py", "serve", "--no-migrate"], env, tmp_path, port=free_port())


def worker(name: str, env: dict[str, str], tmp_path: Path) -> Host:
    argv = [sys.executable, "-m", "celery", "-A", "comminsight_site", "worker", "-P", "solo"]
    argv += ["-Q", env["CELERY_QUEUE"], "-n", f"{name}@%h", "-l", "info"]
    return Host(name, argv, env, tmp_path)


def signed_in(host: Host, username: str) -> httpx.Client:
    """A browser-like client signed in through ``host``'s sign-in page (the session lives in the database)."""
    client = httpx.Client(base_url=host.url, timeout=30, follow_redirects=False)
    page = client.get("/accounts/login/")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
    assert token, page.text[:500]
    answer = client.post(
        "/accounts/login/",
        data={"csrfmiddlewaretoken": token.group(1), "username": username, "password": PASSWORD},
        headers={"Referer": f"{host.url}/accounts/login/"},
    )
    assert answer.status_code == 302, answer.text[:500]
    return client


def on(client: httpx.Client, host: Host) -> httpx.Client:
    """The same session (cookies) against another host."""
    other = httpx.Client(base_url=host.url, timeout=30, follow_redirects=False)
    other.cookies = client.cookies
    return other


def upload(host: Host, secret: str, archive: Path) -> int:
    with archive.open("rb") as handle:
        answer = httpx.post(
            f"{host.url}/api/v1/ingest/archives/",
            headers={"Authorization": f"Bearer {secret}"},
            data={"sha256": sha256_of(archive)},
            files={"file": (archive.name, handle, "application/octet-stream")},
            timeout=60,
        )
    assert answer.status_code == 201, answer.text
    return answer.json()["archive_id"]


def wait_for(predicate, what: str, timeout_s: float = 180):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def analyse(client: httpx.Client, workload_id: int, kind: str, force: bool = False) -> dict:
    answer = client.post(
        f"/api/v1/workloads/{workload_id}/analyses/",
        json={"kind": kind, "force": force},
        headers={"X-CSRFToken": client.cookies["csrftoken"], "Referer": str(client.base_url)},
    )
    assert answer.status_code in (200, 201), answer.text
    job_id = answer.json()["id"]

    def finished():
        job = AnalysisJob.objects.get(pk=job_id)
        return job if job.state in ("done", "failed") and job.attempts >= 1 else None

    job = wait_for(finished, f"the {kind} job")
    assert job.state == "done", job.error
    return answer.json()


def result_through(client: httpx.Client, workload_id: int, job_id: int) -> dict:
    answer = client.get(f"/api/v1/workloads/{workload_id}/analyses/{job_id}/")
    assert answer.status_code == 200, answer.text
    return answer.json()["result"]


def test_two_sites_and_two_workers_sharing_only_postgresql_redis_and_s3_give_identical_results(
    personas, settings, tmp_path, s3_endpoint, s3_storage
):
    if not settings.REDIS_URL or connection.vendor != "postgresql":
        pytest.skip("needs PostgreSQL and Redis shared between processes")
    prefix = s3_storage.removeprefix(f"s3://{s3server.BUCKET}/")  # emptied after the test
    env = shared_environment(settings, s3_endpoint, f"comminsight-hosts-{os.getpid()}", prefix)
    hosts = [site("site-a", env, tmp_path), site("site-b", env, tmp_path)]
    hosts += [worker("worker-a", env, tmp_path), worker("worker-b", env, tmp_path)]
    site_a, site_b, worker_a, worker_b = hosts
    try:
        site_a.wait_until_serving()
        site_b.wait_until_serving()
        # One node's archive through each site (one workload, ranks 0-1 and 2-3).
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        first = upload(site_a, personas.agent_secret, valid_archive(tmp_path / "a", node="10.0.0.1", ranks=(0, 1)))
        second = upload(site_b, personas.agent_secret, valid_archive(tmp_path / "b", node="10.0.0.2", ranks=(2, 3)))
        for archive_id in (first, second):
            wait_for(
                lambda a=archive_id: Archive.objects.get(pk=a).state != ArchiveState.STORED, f"archive {archive_id}"
            )
            archive = Archive.objects.get(pk=archive_id)
            assert archive.state == ArchiveState.INGESTED, archive.reason
            assert archive.path.startswith(f"s3://{s3server.BUCKET}/{prefix}/archives/")
        workload = Workload.objects.get(owner=personas.alice, external_id="job-7")
        assert sorted(workload.ranks.values_list("rank", flat=True)) == [0, 1, 2, 3]

        alice_a = signed_in(site_a, "alice")
        alice_b = on(alice_a, site_b)  # the session is in the shared database: valid on either site
        results = {}
        # steps: two stages over the four ranks; perf: the job's one communicator has more rows than a partition
        # (8), so it is cut into slices of its sequence numbers
        map_tasks = {"hang": 4, "perf": 4, "steps": 8}
        for kind, asked, other in (("hang", alice_a, alice_b), ("perf", alice_b, alice_a), ("steps", alice_a, alice_b)):
            job = analyse(asked, workload.pk, kind)
            assert AnalysisJob.objects.get(pk=job["id"]).partitions == map_tasks[kind]
            first_result = result_through(other, workload.pk, job["id"])
            again = analyse(other, workload.pk, kind, force=True)  # run again, asked through the other site
            assert again["id"] == job["id"]
            assert result_through(asked, workload.pk, job["id"]) == first_result
            results[kind] = first_result
        assert results["hang"]["verdict"] == "no_hang"
        assert results["perf"]["bandwidth"]
        # the two-stage steps run on either worker: what one process gives reading the whole store
        assert results["steps"] == whole_table_result(AnalysisJob.objects.get(pk=job["id"]))
    finally:
        for host in hosts:
            host.stop()
    # Nothing stayed on a host's own disk (scratch is cleaned up): no archive, no store, no summary.
    for host in hosts:
        assert [p for p in host.data_dir.rglob("*") if p.is_file()] == []
    logs = worker_a.log.read_text() + worker_b.log.read_text()
    assert logs.count("map_partition") >= 2  # the chords' map tasks ran in the worker processes
