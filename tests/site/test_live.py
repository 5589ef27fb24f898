"""Live heartbeats: latest per node, workload status across nodes (running, hung, finished, lost)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
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


def test_heartbeat_marks_the_workload_running_and_keeps_the_latest_per_node(agent, personas):
    assert beat(agent, "n1", 5).status_code == 202
    assert beat(agent, "n1", 9).status_code == 202
    workload = Workload.objects.get(external_id="job-live")
    assert workload.owner == personas.alice
    assert workload.status == WorkloadStatus.RUNNING
    node = Node.objects.get(workload=workload, name="n1")
    assert node.last_heartbeat["communicators"][0]["last_completed_seq"] == 9
    assert node.agent_version == "0.1.0"


def test_a_nodes_repeated_heartbeats_run_statements_postgresql_prepared_once(agent):
    if connection.vendor != "postgresql":
        pytest.skip("prepared statements are PostgreSQL's (COMMINSIGHT_DB_PREPARE_THRESHOLD)")
    for seq in range(8):
        assert beat(agent, "n1", seq).status_code == 202
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        prepared = [statement for (statement,) in cursor.fetchall()]
    # The node's row stored and its workload read in one statement, the job's fresh heartbeats, the workload's status.
    assert any(s.startswith("UPDATE") and "RETURNING" in s for s in prepared), prepared
    assert any(s.startswith("SELECT") and "last_heartbeat_at" in s for s in prepared), prepared
    assert Node.objects.get(name="n1").last_heartbeat["communicators"][0]["last_completed_seq"] == 7


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


# --- Root cause across nodes that report separately --------------------------------------------------------

WORLD = 0x5151


def node_evidence(node: str, ranks: range, stuck: int) -> dict:
    """One node's diagnosis evidence as an agent sends it: per rank the last completed all-reduce (seq 9)
    and, for every rank but ``stuck``, the next one (seq 10) in flight for a minute."""
    import base64
    import time

    import numpy as np

    from comminsight.formats import header

    C = header.constants()
    rows = []
    t0 = time.time_ns() - 60_000_000_000
    for rank in ranks:
        for seq, state in ((9, C["CI_STATE_COMPLETED"]), (10, C["CI_STATE_INFLIGHT"])):
            if seq == 10 and rank == stuck:
                continue
            r = np.zeros(1, header.record_dtype())
            r["kind"], r["state"], r["rank"], r["nranks"], r["nnodes"] = C["CI_KIND_COLL"], state, rank, 8, 2
            r["peer"], r["pid"], r["comm_hash"], r["seq"], r["record_seq"] = -1, 1000 + rank, WORLD, seq, seq
            r["bytes"], r["func"], r["comm_name"] = 1 << 20, b"AllReduce", b"world"
            r["enqueue_start_ns"] = r["enqueue_end_ns"] = t0 + seq * 1000
            r["complete_ns"] = t0 + seq * 1000 + 500 if state == C["CI_STATE_COMPLETED"] else 0
            rows.append(r)
    records = np.concatenate(rows)
    header.seal_records(records)
    pid_rank = {str(1000 + rank): rank for rank in ranks}
    return {"node": node, "records": base64.b64encode(records.tobytes()).decode(), "pid_rank": pid_rank}


def beat_with_evidence(client: Client, node: str, ranks: range, hang=None):
    body = {
        "workload_id": "job-live",
        "node": node,
        "communicators": [{"comm_hash": f"0x{WORLD:016x}", "nranks": 8, "last_completed_seq": 9}],
        "hang": hang,
        "evidence": [node_evidence(node, ranks, stuck=6)],
    }
    return client.post(reverse("api-ingest-live"), body, content_type="application/json")


def test_nodes_that_report_separately_get_one_root_cause_across_them(agent, alice, django_capture_on_commit_callbacks):
    # n1 (ranks 0-3) waits inside the all-reduce and, alone, blames the ranks it cannot see; n2 (ranks 4-7)
    # suspects nothing itself but sends its evidence because the site says the job is hung.
    own = {"suspicions": [{"comm_hash": f"0x{WORLD:016x}"}], "root_cause_ranks": [4, 5, 6, 7], "summary": "n1 alone"}
    with django_capture_on_commit_callbacks(execute=True):
        assert beat_with_evidence(agent, "n1", range(0, 4), hang=own).json()["status"] == "hung"
    with django_capture_on_commit_callbacks(execute=True):
        beat_with_evidence(agent, "n2", range(4, 8))
    workload = Workload.objects.get(external_id="job-live")
    root_cause = workload.live_summary["root_cause"]
    assert root_cause["ranks"] == [6]
    assert root_cause["nodes"] == ["n1", "n2"]
    assert root_cause["first_stuck"]["seq"] == 10
    # n1's next heartbeat (its own partial answer) does not replace the answer across nodes.
    with django_capture_on_commit_callbacks(execute=True):
        beat_with_evidence(agent, "n1", range(0, 4), hang=own)
    assert Workload.objects.get(pk=workload.pk).live_summary["root_cause"]["ranks"] == [6]
    page = alice.get(reverse("workloads:detail", args=[workload.pk])).content.decode()
    assert 'id="root-cause"' in page
    assert "all_reduce seq 10" in page
    assert "root cause: rank 6" in alice.get(reverse("workloads:list")).content.decode()


def test_diagnosis_evidence_is_not_kept_in_the_heartbeat_row(agent):
    beat_with_evidence(agent, "n1", range(0, 4), hang={"suspicions": [{"comm_hash": "0xaa"}]})
    assert "evidence" not in Node.objects.get(name="n1").last_heartbeat


def test_unusable_evidence_is_skipped_and_the_heartbeat_still_counts(agent, django_capture_on_commit_callbacks):
    hang = {"suspicions": [{"comm_hash": "0xaa"}]}
    with django_capture_on_commit_callbacks(execute=True):
        beat_with_evidence(agent, "n1", range(0, 4), hang=hang)
        body = {"workload_id": "job-live", "node": "n2", "evidence": [{"records": "not base64!", "pid_rank": {}}]}
        assert agent.post(reverse("api-ingest-live"), body, content_type="application/json").status_code == 202
    workload = Workload.objects.get(external_id="job-live")
    assert workload.status == WorkloadStatus.HUNG
    assert "root_cause" not in workload.live_summary
    assert Node.objects.filter(workload=workload).count() == 2


def test_a_merged_root_cause_goes_when_the_job_runs_again(agent, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        beat_with_evidence(agent, "n1", range(0, 4), hang={"suspicions": [{"comm_hash": "0xaa"}]})
        beat_with_evidence(agent, "n2", range(4, 8))
    assert Workload.objects.get(external_id="job-live").live_summary["root_cause"]["merged"]
    beat(agent, "n1", 11)
    workload = Workload.objects.get(external_id="job-live")
    assert workload.status == WorkloadStatus.RUNNING
    assert "root_cause" not in workload.live_summary


@pytest.mark.parametrize(
    "raw",
    [
        '{"node": "a", "communicators": [{"comm_hash": "c", "last_completed_seq": 7}], "finished": false}',
        '{"sent_ns": 123456789012345678901234567890}',  # beyond 64 bits: kept exact
        '{"x": NaN}',  # SQLite may hold it (json.dumps writes NaN)
        '{"s": "\\u00e9\\ud83d\\ude00", "f": 1.5e300, "n": null}',
    ],
)
def test_fresh_heartbeats_decode_as_the_json_field_does(raw):
    from apps.workloads.live import _heartbeat_loads
    from comminsight_site import rows

    convert = rows.converter(Node, "last_heartbeat")
    decoded = _heartbeat_loads(raw, convert)
    expected = convert(raw)
    assert repr(decoded) == repr(expected)  # repr: NaN is not equal to itself
