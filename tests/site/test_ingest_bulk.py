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
