"""Communicator rows on the site get the process group's name, description and member ranks.

Evidence: a real 8-rank PyTorch 2.11 / NCCL job run with the import hook (tests/data/inject_gpu_lab_8rank),
sealed by the agent's archiver and ingested like any upload.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from django.urls import reverse

from apps.analysis.services import trace_export
from apps.workloads import ingest
from apps.workloads.models import ArchiveState, Workload
from comminsight.agent.archiver import Archiver
from comminsight.agent.spool import Spool
from comminsight.formats.archive import ArchiveMember, write_archive
from comminsight_site.objectstore import object_store
from tests.site.test_ingest_archives import register

GPU_LAB = Path(__file__).resolve().parents[1] / "data" / "inject_gpu_lab_8rank"


def seal(home: Path, metadata_dir: Path) -> Path:
    spool = Spool(home / "spool", [], max_bytes=1 << 30, max_age_s=3600)
    archiver = Archiver(
        home / "inspector_logs",
        home / "hang_detection",
        home / "state",
        spool,
        workload_id="gpu-lab",
        node="lab",
        host="lab",
        node_ip="",
        orphan_grace_s=0.0,
        proc_root=home / "no-proc",
        metadata_dir=metadata_dir,
    )
    archiver.recover()
    entry = archiver.seal(final=True)
    assert entry is not None
    return entry.path


def test_ingested_communicators_carry_their_process_group_names_and_the_page_shows_them(client, personas, tmp_path):
    home = tmp_path / "home"
    shutil.copytree(GPU_LAB, home)
    archive = register(seal(home, home / "metadata"), personas.alice)
    assert ingest.archive_ingest(archive.pk) == ArchiveState.INGESTED
    comms = Workload.objects.get(external_id="gpu-lab").communicators.all()
    assert len(comms) == 12
    assert {c.group_desc for c in comms} == {
        "TENSOR_MODEL_PARALLEL_GROUP",
        "DATA_PARALLEL_GROUP",
        "PIPELINE_MODEL_PARALLEL_GROUP",
    }
    stuck = next(c for c in comms if c.comm_hash == "0xd1efdb26359be2b8")  # where the injected hang stopped
    assert (stuck.group_desc, stuck.group_name, stuck.member_ranks) == ("DATA_PARALLEL_GROUP", "8", [5, 7])
    assert str(stuck) == "DATA_PARALLEL_GROUP (8)"
    client.force_login(personas.alice)
    page = client.get(reverse("workloads:detail", kwargs={"workload_id": stuck.workload_id})).content.decode()
    assert "DATA_PARALLEL_GROUP (8)" in page
    trace = json.loads(object_store().read_bytes(trace_export(stuck.workload)))
    assert any(e["name"] == "all_reduce · DATA_PARALLEL_GROUP" for e in trace["traceEvents"] if e.get("ph") == "X")


def test_tables_arriving_in_a_later_archive_name_the_communicators_ingested_before(personas, tmp_path):
    home = tmp_path / "home"
    shutil.copytree(GPU_LAB, home)
    empty = tmp_path / "no-tables"
    empty.mkdir()
    first = register(seal(home, empty), personas.alice)
    assert ingest.archive_ingest(first.pk) == ArchiveState.INGESTED
    workload = Workload.objects.get(external_id="gpu-lab")
    assert not any(c.group_desc for c in workload.communicators.all())

    tables = sorted((home / "metadata").glob("process_groups-*.json"))
    hostile = ArchiveMember("metadata/process_groups-evil-9.json", data=b'{"format": "comminsight.process_groups"')
    manifest = {
        "workload_id": "gpu-lab",
        "node": "lab",
        "host": "lab",
        "node_ip": "",
        "created_ns": 1,
        "time_range": {"first_ns": 1, "last_ns": 2},
        "ranks": [],
        "communicators": [],
        "dropped": {"ring": 0, "lost": 0},
    }
    later = tmp_path / "later.tar.zst"
    write_archive(later, manifest, [hostile, *(ArchiveMember(f"metadata/{t.name}", path=t) for t in tables)])
    second = register(later, personas.alice)
    assert ingest.archive_ingest(second.pk) == ArchiveState.INGESTED  # the bad table is skipped, not fatal
    assert all(c.group_desc for c in workload.communicators.all())
