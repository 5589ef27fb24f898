"""The site reads an uploaded archive exactly as the CLI reads the home it came from.

Archives are sealed by the agent's own archiver, ingested by the site's real ingest, and read back
through ``load_operations``; the operations table (and, for a simulated job, the hang analysis) must
equal what ``comminsight`` gives on the home. The decoder's other paths: tests/formats/test_record_decoder.py.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from django.test import Client
from django.urls import reverse
from hypothesis import HealthCheck, given, settings

from apps.analysis.services import load_operations
from apps.workloads import ingest
from apps.workloads.models import Archive, ArchiveState, Workload
from apps.workloads.names import operations_named
from apps.workloads.uploads import archive_register
from comminsight.importers import load
from comminsight.importers import rawlog as rawlog_importer
from tests.formats.generated_segments import job, seal_archive, write_home
from tests.site.archives import sha256_of

REPO = Path(__file__).resolve().parents[2]
_examples = itertools.count()


def ingested_workload(archive: Path, owner, workload_id: str) -> Workload:
    registered, _ = archive_register(
        source_path=archive, sha256=sha256_of(archive), size=archive.stat().st_size, owner=owner, filename=archive.name
    )
    assert ingest.archive_ingest(registered.pk) == ArchiveState.INGESTED, Archive.objects.get(pk=registered.pk).reason
    return Workload.objects.get(owner=owner, external_id=workload_id)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=job.filter(lambda segments: any(s["records"] for s in segments)))
def test_the_site_stores_and_reads_back_the_rows_the_cli_reads_from_the_home(personas, tmp_path_factory, spec):
    root = tmp_path_factory.mktemp("site-decoder")
    workload_id = f"generated-{next(_examples)}"
    home = write_home(root / "home", spec)
    workload = ingested_workload(seal_archive(home, root / "agent", workload_id), personas.alice, workload_id)
    from_site = load_operations(ingest.workload_parquet_files(workload))
    assert from_site.equals(rawlog_importer.load(home))


def comminsight(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", "from comminsight.cli import main; main()", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.slow
def test_the_sites_hang_analysis_of_an_uploaded_archive_equals_the_clis_on_the_home(
    personas, tmp_path, settings, django_capture_on_commit_callbacks
):
    settings.ANALYSIS_PARTITION_ROWS = 50  # one rank per map task: P2P peers live in other partitions
    build = subprocess.run(["make", "-s", "-C", str(REPO / "native/profiler")], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    home = tmp_path / "home"
    # The 8-rank Megatron hang of the issue: rank 5 stops; P2P between pipeline stages crosses ranks.
    run = comminsight(
        *("simulate", "run", "-o", str(home), "--layout", "megatron", "--ranks", "8", "--tp", "2", "--pp", "2"),
        *("--scenario", "hang", "--rank", "5", "--steps", "3"),
    )
    assert run.returncode == 0, run.stderr
    cli = comminsight("analyze", "hang", str(home), "--format", "json")
    assert cli.returncode == 0, cli.stderr
    from_cli = json.loads(cli.stdout)
    assert from_cli["root_cause_ranks"] == [5]

    archive = seal_archive(home, tmp_path / "agent", "megatron-hang")
    agent = Client(HTTP_AUTHORIZATION=f"Bearer {personas.agent_secret}")
    with django_capture_on_commit_callbacks(execute=True), archive.open("rb") as handle:
        uploaded = agent.post(reverse("api-ingest-archives"), {"file": handle, "sha256": sha256_of(archive)})
    assert uploaded.status_code == 201, uploaded.content
    workload = Workload.objects.get(owner=personas.alice, external_id="megatron-hang")
    assert workload.archives.get().state == ArchiveState.INGESTED

    with ingest.workload_metadata_dir(workload) as tables:
        site_table = operations_named(load_operations(ingest.workload_parquet_files(workload)), tables)
    assert site_table.equals(load(home))

    client = Client()
    client.force_login(personas.alice)
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(
            reverse("api-analyses", kwargs={"workload_id": workload.pk}),
            data=json.dumps({"kind": "hang"}),
            content_type="application/json",
        )
    assert response.status_code == 201, response.content
    job = client.get(
        reverse("api-analysis-detail", kwargs={"workload_id": workload.pk, "job_id": response.json()["id"]})
    ).json()
    assert job["state"] == "done", job
    # The CLI adds how communicators were named ("names"); the site shows that on its communicator rows.
    assert job["result"] == {key: value for key, value in from_cli.items() if key != "names"}
