"""Bulk metadata writes: the database-side merge and the portable ORM path agree, row for row."""

from __future__ import annotations

import pytest

from apps.workloads import bulk
from apps.workloads.models import Communicator, Node, Rank, Workload

FIRST = [
    {"comm_hash": "0x0000000000000001", "comm_name": "", "nranks": 2, "ranks": [1, 0], "positions": {"0": 0}},
    {"comm_hash": "0x0000000000000002", "comm_name": "tp0", "nranks": 4, "ranks": [0], "first_ns": 50},
]
SECOND = [
    {"comm_hash": "0x0000000000000001", "comm_name": "dp", "nranks": 4, "ranks": [3, 2], "positions": {"2": 1}},
    {"comm_hash": "0x0000000000000002", "comm_name": "other", "nranks": 2, "ranks": [1], "first_ns": 20},
    {"comm_hash": "0x0000000000000003", "comm_name": "", "nranks": 0, "ranks": [5], "first_ns": None},
]


@pytest.mark.parametrize("merge", [bulk._merge_postgresql, bulk._merge_orm], ids=["database", "orm"])
def test_merging_communicators_unites_members_and_keeps_the_first_name(personas, merge, settings):
    if merge is bulk._merge_postgresql and "postgresql" not in settings.DATABASES["default"]["ENGINE"]:
        pytest.skip("the database-side merge is PostgreSQL's")
    workload = Workload.objects.create(name="w", external_id="w", owner=personas.alice)
    for comms in (FIRST, SECOND):
        rows = [{"positions": {}, "first_ns": None, **c, "ranks": sorted(c["ranks"])} for c in comms]
        merge(workload, sorted(rows, key=lambda r: r["comm_hash"]))
    found = {
        c.comm_hash: (c.comm_name, c.nranks, c.ranks, c.positions, c.first_ns)
        for c in Communicator.objects.filter(workload=workload)
    }
    assert found == {
        "0x0000000000000001": ("dp", 4, [0, 1, 2, 3], {"0": 0, "2": 1}, None),
        "0x0000000000000002": ("tp0", 4, [0, 1], {}, 20),
        "0x0000000000000003": ("", 0, [5], {}, None),
    }


def test_a_rank_seen_again_moves_to_the_node_that_reports_it(personas):
    workload = Workload.objects.create(name="w", external_id="w", owner=personas.alice)
    first, second = (Node.objects.create(workload=workload, name=n) for n in ("a", "b"))
    bulk.ranks_upsert(workload, first, [3, 1, 2, 1])
    bulk.ranks_upsert(workload, second, [2, 4])
    assert dict(Rank.objects.filter(workload=workload).values_list("rank", "node__name")) == {
        1: "a",
        2: "b",
        3: "a",
        4: "b",
    }


@pytest.mark.django_db(transaction=True)
def test_an_archive_being_ingested_holds_up_no_other_archive_of_its_workload(personas, tmp_path, monkeypatch):
    """Node A's archive is paused while it publishes (reading and converting are done, nothing committed);
    node B's archive of the same workload is ingested meanwhile: no row lock of A's attempt is in its way."""
    import threading

    from django.db import connection

    from apps.workloads import ingest
    from apps.workloads.models import Archive, ArchiveState
    from tests.site.archives import sha256_of, valid_archive

    def stored(path):  # the row only: no task runs it before the test does
        return Archive.objects.create(
            sha256=sha256_of(path), size=path.stat().st_size, filename=path.name, owner=personas.alice, path=str(path)
        )

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = stored(valid_archive(tmp_path / "a", ranks=(0, 1)))
    second = stored(valid_archive(tmp_path / "b", node="10.0.0.2", ranks=(2, 3)))
    publishing, resume = threading.Event(), threading.Event()
    real_publish = ingest._publish

    def publish(staged, workload, archive):
        if archive.pk == first.pk:
            publishing.set()
            resume.wait(timeout=120)
        return real_publish(staged, workload, archive)

    monkeypatch.setattr(ingest, "_publish", publish)
    outcome = {}

    def run(archive_id: int) -> None:
        try:
            outcome[archive_id] = ingest.archive_ingest(archive_id)
        finally:
            connection.close()

    paused = threading.Thread(target=run, args=(first.pk,))
    paused.start()
    try:
        assert publishing.wait(timeout=120)
        other = threading.Thread(target=run, args=(second.pk,))
        other.start()
        other.join(timeout=120)
        assert outcome.get(second.pk) == ArchiveState.INGESTED  # while the first is still in the middle
    finally:
        resume.set()
        paused.join(timeout=120)
    assert outcome[first.pk] == ArchiveState.INGESTED
    workload = Workload.objects.get(owner=personas.alice, external_id="job-7")
    assert sorted(workload.ranks.values_list("rank", flat=True)) == [0, 1, 2, 3]
    assert workload.communicators.get().ranks == [0, 1, 2, 3]
