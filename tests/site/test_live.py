"""Live heartbeats: latest per node, workload status across nodes (running, hung, finished, lost)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from apps.workloads.live import mark_lost_workloads
from apps.workloads.models import Node, Workload, WorkloadStatus


def beat(client: Client, node: str, seq: int, lagging=(), hang=None, finished=False, workload="job-live"):
    body = {
        "workload_id": workload,
        "node": node,
        "host": f"host-{node}",
        "agent_version": "0.1.0",
        "sent_ns": 1,
        "ranks": [0, 1],
        "communicators": [
            {"comm_hash": "0x00000000000000aa", "nranks": 4, "last_completed_seq": seq, "lagging_ranks": list(lagging)}
        ],
        "hang": hang,
        "finished": finished,
    }
    return client.post(reverse("api-ingest-live"), body, content_type="application/json")


@pytest.fixture
def alice(personas) -> Client:
    client = Client()
    client.force_login(personas.alice)
    return client


@pytest.fixture
def agent(personas) -> Client:
    return Client(HTTP_AUTHORIZATION=f"Bearer {personas.agent_secret}")


def test_heartbeat_marks_the_workload_running_and_keeps_the_latest_per_node(agent, personas):
    assert beat(agent, "n1", 5).status_code == 202
    assert beat(agent, "n1", 9).status_code == 202
    workload = Workload.objects.get(external_id="job-live")
    assert workload.owner == personas.alice
    assert workload.status == WorkloadStatus.RUNNING
    node = Node.objects.get(workload=workload, name="n1")
    assert node.last_heartbeat["communicators"][0]["last_completed_seq"] == 9
    assert node.agent_version == "0.1.0"


def test_hang_on_one_node_names_the_lagging_ranks_across_nodes(agent):
    beat(agent, "n1", 100)
    response = beat(agent, "n2", 42, lagging=[6], hang=[{"comm_hash": "0x00000000000000aa", "ranks": [6]}])
    assert response.json()["status"] == "hung"
    workload = Workload.objects.get(external_id="job-live")
    assert workload.status == WorkloadStatus.HUNG
    assert workload.live_summary["lagging_ranks"] == [6]
    assert workload.live_summary["communicators"][0]["behind_nodes"] == ["n2"]


def test_workload_is_finished_when_every_node_says_so(agent):
    beat(agent, "n1", 10, finished=True)
    beat(agent, "n2", 10)
    assert Workload.objects.get(external_id="job-live").status == WorkloadStatus.RUNNING
    beat(agent, "n2", 10, finished=True)
    assert Workload.objects.get(external_id="job-live").status == WorkloadStatus.FINISHED


def test_silent_workload_becomes_lost(agent, settings):
    beat(agent, "n1", 1)
    Workload.objects.filter(external_id="job-live").update(
        last_seen_at=timezone.now() - timedelta(seconds=settings.WORKLOAD_LOST_AFTER_S + 1)
    )
    assert mark_lost_workloads() == 1
    assert Workload.objects.get(external_id="job-live").status == WorkloadStatus.LOST


def test_each_owners_token_reports_into_its_own_workload(agent, personas):
    beat(agent, "n1", 1)
    carol = Client(HTTP_AUTHORIZATION=f"Bearer {personas.carol_agent_secret}")
    beat(carol, "n1", 1)
    owners = set(Workload.objects.filter(external_id="job-live").values_list("owner__username", flat=True))
    assert owners == {"alice", "carol"}


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"workload_id": "", "node": "n1"},
        {"workload_id": "w" * 201, "node": "n1"},
        {"workload_id": "w", "node": "n1", "communicators": [{"nranks": 2}]},
        {"workload_id": "w", "node": "n1", "communicators": "all"},
        {"workload_id": "w", "node": "n1", "ranks": ["zero"]},
        {"workload_id": "w", "node": "n1", "sent_ns": -1},
    ],
)
def test_malformed_heartbeats_are_refused_and_change_nothing(agent, body):
    response = agent.post(reverse("api-ingest-live"), body, content_type="application/json")
    assert response.status_code == 400
    assert not Workload.objects.filter(external_id__in=["w", ""]).exists()


def test_oversized_heartbeat_is_refused(agent, settings):
    settings.INGEST_LIVE_MAX_BYTES = 100
    response = beat(agent, "n1", 1)
    assert response.status_code == 413
    assert not Workload.objects.filter(external_id="job-live").exists()


def test_root_cause_named_by_an_agent_shows_on_the_workload_page_and_in_the_list(agent, alice):
    hang = {
        "suspicions": [{"comm_hash": "0x00000000000000aa", "op": "AllReduce", "seq": 12}],
        "root_cause_ranks": [5],
        "first_stuck": {"comm_hash": "0x00000000000000aa", "op": "all_reduce", "seq": 12, "ranks": [5]},
        "summary": "Hang: progress stopped first at rank(s) 5.",
    }
    beat(agent, "n1", 100)
    assert beat(agent, "n2", 12, lagging=[5], hang=hang).json()["status"] == "hung"
    workload = Workload.objects.get(external_id="job-live")
    assert workload.live_summary["root_cause"]["ranks"] == [5]
    assert workload.live_summary["root_cause"]["node"] == "n2"
    page = alice.get(reverse("workloads:detail", args=[workload.pk])).content.decode()
    assert 'id="root-cause"' in page
    assert "all_reduce seq 12" in page
    listing = alice.get(reverse("workloads:list")).content.decode()
    assert "root cause: rank 5" in listing


def test_a_hang_without_a_root_cause_yet_shows_no_root_cause(agent, alice):
    beat(agent, "n2", 12, lagging=[5], hang={"suspicions": [{"comm_hash": "0xaa"}], "root_cause_ranks": None})
    workload = Workload.objects.get(external_id="job-live")
    assert workload.status == WorkloadStatus.HUNG
    assert "root_cause" not in workload.live_summary
    page = alice.get(reverse("workloads:detail", args=[workload.pk])).content.decode()
    assert 'id="root-cause"' not in page


def test_a_job_aborted_while_hung_stays_hung_when_its_nodes_report_finished(agent):
    beat(agent, "n1", 10)
    beat(agent, "n1", 12, lagging=[2], hang=[{"comm_hash": "0x00000000000000aa", "ranks": [2]}])
    # The launcher aborts the job: the suspicion is gone and the agent's last report says finished.
    beat(agent, "n1", 12, finished=True)
    assert Workload.objects.get(external_id="job-live").status == WorkloadStatus.HUNG


def test_a_hung_job_that_makes_progress_again_is_running(agent):
    beat(agent, "n1", 12, lagging=[2], hang=[{"comm_hash": "0x00000000000000aa", "ranks": [2]}])
    beat(agent, "n1", 13)
    assert Workload.objects.get(external_id="job-live").status == WorkloadStatus.RUNNING


def test_lagging_ranks_are_global_ranks_not_indices_inside_the_communicator(agent):
    body = {
        "workload_id": "job-live",
        "node": "n1",
        "communicators": [
            {
                "comm_hash": "0x00000000000000bb",
                "nranks": 2,
                "last_completed_seq": 7,
                "lagging_ranks": [1],  # index 1 of a data-parallel group {1, 5}
                "ranks": {"0": {"global_rank": 1}, "1": {"global_rank": 5}},
            }
        ],
        "hang": [{"comm_hash": "0x00000000000000bb"}],
    }
    agent.post(reverse("api-ingest-live"), body, content_type="application/json")
    workload = Workload.objects.get(external_id="job-live")
    assert workload.live_summary["lagging_ranks"] == [5]
    assert workload.live_summary["communicators"][0]["lagging_ranks"] == [5]
