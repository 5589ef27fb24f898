"""Workload pages beyond the API: sharing, deletion, topology, Step and Hang counts, lagging ranks, the demo."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from apps.analysis.models import AnalysisJob, JobState
from apps.workloads.models import Communicator, Node, Rank, ShareLevel, Workload, WorkloadShare, WorkloadStatus


def signed_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_owner_shares_a_workload_with_manage_level_from_the_page(personas):
    response = signed_in(personas.alice).post(
        reverse("workloads:sharing", kwargs={"workload_id": personas.workload.pk}),
        {"action": "share", "username": "carol", "level": "manage"},
    )
    assert response.status_code == 302
    share = WorkloadShare.objects.get(workload=personas.workload, user=personas.carol)
    assert share.level == ShareLevel.MANAGE
    page = signed_in(personas.carol).get(reverse("workloads:sharing", kwargs={"workload_id": personas.workload.pk}))
    assert page.status_code == 200


def test_sharing_with_an_unknown_user_says_so_and_changes_nothing(personas):
    response = signed_in(personas.alice).post(
        reverse("workloads:sharing", kwargs={"workload_id": personas.workload.pk}),
        {"action": "share", "username": "mallory", "level": "read"},
    )
    assert response.status_code == 400
    assert "No user has that name" in response.content.decode()
    assert WorkloadShare.objects.filter(workload=personas.workload).count() == 1


def test_owner_unshares_and_the_user_no_longer_sees_the_workload(personas):
    signed_in(personas.alice).post(
        reverse("workloads:sharing", kwargs={"workload_id": personas.workload.pk}),
        {"action": "unshare", "user_id": personas.bob.pk},
    )
    detail = signed_in(personas.bob).get(reverse("workloads:detail", kwargs={"workload_id": personas.workload.pk}))
    assert detail.status_code == 404


def test_read_share_cannot_share_further(personas):
    response = signed_in(personas.bob).post(
        reverse("workloads:sharing", kwargs={"workload_id": personas.workload.pk}),
        {"action": "share", "username": "carol", "level": "manage"},
    )
    assert response.status_code == 403
    assert not WorkloadShare.objects.filter(user=personas.carol).exists()


def test_delete_needs_the_workload_name_typed(personas):
    url = reverse("workloads:delete", kwargs={"workload_id": personas.workload.pk})
    wrong = signed_in(personas.alice).post(url, {"confirm": "yes"})
    assert wrong.status_code == 400
    assert Workload.objects.filter(pk=personas.workload.pk).exists()
    right = signed_in(personas.alice).post(url, {"confirm": personas.workload.name})
    assert right.status_code == 302
    assert not Workload.objects.filter(pk=personas.workload.pk).exists()


def _megatron_members(workload: Workload) -> None:
    node = Node.objects.create(workload=workload, name="10.0.0.1")
    for rank in range(8):
        Rank.objects.create(workload=workload, node=node, rank=rank)
    groups = {
        "tp0": [0, 1], "tp1": [2, 3], "tp2": [4, 5], "tp3": [6, 7],
        "pp0": [0, 4], "pp1": [1, 5], "pp2": [2, 6], "pp3": [3, 7],
        "dp0": [0, 2], "dp1": [1, 3], "dp2": [4, 6], "dp3": [5, 7],
    }  # fmt: skip
    for index, (name, ranks) in enumerate(groups.items()):
        Communicator.objects.create(
            workload=workload, comm_hash=f"0x{index:016x}", comm_name=name, nranks=len(ranks), ranks=ranks
        )


def test_topology_gives_each_rank_its_tp_pp_dp_coordinates_and_a_picture(personas):
    _megatron_members(personas.workload)
    response = signed_in(personas.bob).get(reverse("workloads:topology", kwargs={"workload_id": personas.workload.pk}))
    assert response.status_code == 200
    rows = {r["rank"]: r for r in response.context["ranks"]}
    assert (rows[5]["tp"][1], rows[5]["pp"][1], rows[5]["dp"][1]) == (1, 1, 0)
    graph = response.context["chart"]["series"][0]
    assert {n["id"] for n in graph["data"]} == {str(r) for r in range(8)}
    assert any(link["source"] == "4" and link["target"] == "5" for link in graph["links"])  # tp2
    assert 'data-chart="topology-chart"' in response.content.decode()


def test_topology_lists_what_nccl_chose_per_group_in_name_order(personas, data_dir):
    import pyarrow as pa

    from tests.site.analysis_tables import hung_table, write_store

    _megatron_members(personas.workload)
    table = hung_table(ranks=4, ops=4)
    groups = ["0x0000000000000008", "0x0000000000000001", "0x0000000000000004", "0x0000000000000000"]  # dp0 tp1 pp0 tp0
    table = table.set_column(
        table.schema.get_field_index("comm_id"), "comm_id", pa.array([groups[i % 4] for i in range(len(table))])
    )
    for name, value in (("algo", "Ring"), ("proto", "Simple"), ("n_channels", 2)):
        column = pa.array([value] * len(table), type=table.schema.field(name).type)
        table = table.set_column(table.schema.get_field_index(name), name, column)
    write_store(data_dir, personas.workload.pk, table)
    response = signed_in(personas.alice).get(
        reverse("workloads:topology", kwargs={"workload_id": personas.workload.pk})
    )
    facts = response.context["facts"]
    assert [fact["communicator"].comm_name for fact in facts] == ["dp0", "pp0", "tp0", "tp1"]
    assert {(fact["algo"], fact["proto"], fact["max_channels"]) for fact in facts} == {("Ring", "Simple", 2)}


def test_list_shows_steps_and_hangs_from_the_newest_results(personas):
    AnalysisJob.objects.create(
        workload=personas.workload,
        kind="steps",
        parameters_key="s",
        state=JobState.DONE,
        result={"steps": [{"step": i, "duration_ms": 10.0} for i in range(9)]},
    )
    AnalysisJob.objects.create(
        workload=personas.workload, kind="hang", parameters_key="h", state=JobState.DONE, result={"verdict": "hang"}
    )
    response = signed_in(personas.alice).get(reverse("workloads:list"))
    row = next(w for w in response.context["workloads"] if w.pk == personas.workload.pk)
    assert row.analysis_counts["steps"] == 9
    assert row.analysis_counts["hang"] == "hang"
    html = response.content.decode()
    assert '<th class="num" title="Steps recovered by the newest Steps analysis">Steps</th>' in html


def test_detail_page_shows_lagging_ranks_as_global_ranks(personas):
    Workload.objects.filter(pk=personas.workload.pk).update(
        status=WorkloadStatus.HUNG, live_summary={"lagging_ranks": [5], "communicators": []}
    )
    response = signed_in(personas.alice).get(reverse("workloads:detail", kwargs={"workload_id": personas.workload.pk}))
    assert "lagging ranks (global, all nodes)" in response.content.decode()
    assert response.context["lagging_ranks"] == [5]


@pytest.mark.parametrize("persona", ["alice", "bob", "carol"])
def test_only_administrators_are_offered_and_may_start_the_demo(personas, persona):
    Workload.objects.all().delete()
    client = signed_in(getattr(personas, persona))
    assert "Run a demo job" not in client.get(reverse("workloads:list")).content.decode()
    assert client.post(reverse("workloads:demo")).status_code == 404
    assert not Workload.objects.exists()


def test_an_empty_site_offers_the_demo_to_root(personas):
    Workload.objects.all().delete()
    page = signed_in(personas.root).get(reverse("workloads:list")).content.decode()
    assert "Run a demo job" in page
    assert "manage.py demo" in page


def test_workload_detail_api_counts_nodes_ranks_and_archives_like_the_list(personas):
    _megatron_members(personas.workload)
    client = signed_in(personas.alice)
    detail = client.get(reverse("api-workload-detail", kwargs={"workload_id": personas.workload.pk})).json()
    listed = next(w for w in client.get(reverse("api-workloads")).json() if w["id"] == personas.workload.pk)
    assert (detail["nodes"], detail["ranks"], detail["archives"]) == (1, 8, 0)
    assert {k: detail[k] for k in ("nodes", "ranks", "archives")} == {
        k: listed[k] for k in ("nodes", "ranks", "archives")
    }


def test_a_hidden_workload_is_the_sites_own_404_page(personas):
    response = signed_in(personas.carol).get(reverse("workloads:detail", kwargs={"workload_id": personas.workload.pk}))
    assert response.status_code == 404
    html = response.content.decode()
    assert "not shared with you" in html
    assert "URLconf" not in html


def test_every_page_has_an_icon(client):
    response = client.get("/favicon.ico")
    assert response.status_code == 200
    assert response["Content-Type"] == "image/svg+xml"


def test_about_tells_the_version_and_how_the_parts_work_together(personas):
    import importlib.metadata

    page = signed_in(personas.bob).get(reverse("accounts:about")).content.decode()
    assert importlib.metadata.version("comminsight") in page
    assert 'data-chart="architecture-chart"' in page
    assert "docs/site.md" in page
