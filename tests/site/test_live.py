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
