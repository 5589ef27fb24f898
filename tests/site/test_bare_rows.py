"""The agents' per-request statements on a bare cursor (comminsight_site.rows) and the serializers whose fields
are built once per thread: the same objects and answers as the ORM's and DRF's own."""

from __future__ import annotations

import copy
import threading
import uuid
from datetime import timedelta

import pytest
from django.db import NotSupportedError, connection
from django.utils import timezone
from rest_framework import serializers

from apps.accounts.models import AgentToken, User
from apps.accounts.services import agent_token_authenticate
from apps.workloads import live, uploads
from apps.workloads.api.ingest import HeartbeatSerializer, UploadCreateSerializer
from apps.workloads.models import Archive, Node, Upload, UploadState, Workload
from comminsight_site import rows


def values(instance) -> dict:
    return {field.attname: getattr(instance, field.attname) for field in type(instance)._meta.concrete_fields}


def test_a_row_read_on_a_bare_cursor_is_the_orms_row(personas):
    workload = personas.workload
    Workload.objects.filter(pk=workload.pk).update(
        live_summary={"nodes": 2, "lagging_ranks": [3, 5], "root_cause": {"summary": "rank 3 stopped"}},
        first_seen_at=timezone.now() - timedelta(hours=1),
    )
    read = rows.select_one(Workload, f"t.{rows.column(Workload, 'id')} = %s", [workload.pk])
    assert values(read) == values(Workload.objects.get(pk=workload.pk))
    assert read.live_summary["root_cause"] == {"summary": "rank 3 stopped"}
    upload = Upload.objects.create(
        id=uuid.uuid4(), token=personas.agent_token, owner=personas.alice, sha256="a" * 64, size=10, filename="x"
    )
    assert values(uploads.upload_get(owner=personas.alice, upload_id=upload.pk)) == values(
        Upload.objects.get(pk=upload.pk)
    )
    assert uploads.upload_get(owner=personas.carol, upload_id=upload.pk) is None
    assert rows.select_one(Workload, f"t.{rows.column(Workload, 'id')} = %s", [-1]) is None


def test_the_token_read_with_its_owner_is_the_orms(personas):
    token = agent_token_authenticate(personas.agent_secret)
    stored = AgentToken.objects.select_related("owner").get(pk=personas.agent_token.pk)
    assert values(token) == values(stored)
    assert values(token.owner) == values(stored.owner)
    assert isinstance(token.owner, User)
    assert token.owner.username == "alice"
    assert agent_token_authenticate(personas.agent_secret[:-1] + "x") is None
    assert agent_token_authenticate("ci_nosuchprefix_secret") is None


def test_a_heartbeat_keeps_a_known_nodes_host_when_it_sends_none(personas):
    heartbeat = {"workload_id": "job-rows", "node": "n1", "host": "h1", "agent_version": "1.0"}
    live.live_record_heartbeat(token=personas.agent_token, heartbeat=heartbeat)
    live.live_record_heartbeat(token=personas.agent_token, heartbeat={**heartbeat, "host": "", "sent_ns": 7})
    node = Node.objects.get(workload__external_id="job-rows", name="n1")
    assert (node.host, node.agent_version, node.last_heartbeat["sent_ns"]) == ("h1", "1.0", 7)


def test_a_node_silent_past_the_limit_is_left_out_of_the_summary(personas, settings):
    for name in ("n1", "n2"):
        live.live_record_heartbeat(token=personas.agent_token, heartbeat={"workload_id": "job-rows", "node": name})
    Node.objects.filter(name="n2").update(
        last_heartbeat_at=timezone.now() - timedelta(seconds=settings.WORKLOAD_LOST_AFTER_S + 60)
    )
    workload = live.live_record_heartbeat(
        token=personas.agent_token, heartbeat={"workload_id": "job-rows", "node": "n1"}
    )
    assert workload.live_summary["nodes"] == 1
    assert Workload.objects.get(pk=workload.pk).live_summary["nodes"] == 1


def test_the_quota_counts_stored_archives_and_open_uploads_but_not_the_one_left_out(personas):
    Archive.objects.create(owner=personas.alice, sha256="b" * 64, size=1000, filename="a", path="p")
    kept = Upload.objects.create(
        id=uuid.uuid4(), token=personas.agent_token, owner=personas.alice, sha256="c" * 64, size=200, filename="c"
    )
    Upload.objects.create(
        id=uuid.uuid4(), token=personas.agent_token, owner=personas.alice, sha256="d" * 64, size=30, filename="d"
    )
    Upload.objects.create(
        id=uuid.uuid4(),
        token=personas.agent_token,
        owner=personas.alice,
        sha256="e" * 64,
        size=4,
        filename="e",
        state=UploadState.COMPLETE,
    )
    assert uploads.owner_bytes_in_use(personas.alice) == 1230
    assert uploads.owner_bytes_in_use(personas.alice, exclude_upload=kept) == 1030
    assert uploads.owner_bytes_in_use(personas.carol) == 0


def plain(serializer_class: type[serializers.Serializer]) -> type[serializers.Serializer]:
    """The same declared fields in a stock DRF serializer (fields deep-copied for every instance)."""
    return type("Plain", (serializers.Serializer,), copy.deepcopy(serializer_class._declared_fields))


HEARTBEATS = [
    {"workload_id": "j", "node": "n1", "communicators": [{"comm_hash": "a", "nranks": 4, "lagging_ranks": [1]}]},
    {"workload_id": "j", "node": 7, "finished": "yes"},
    {"workload_id": "j", "node": "n2", "communicators": [{"nranks": -1}], "sent_ns": -5},
    {"node": "n3", "ranks": [0, 1, "two"]},
    {"workload_id": "j", "node": "n4", "finished": True, "ranks": [0, 1]},
    ["not", "an", "object"],
]
CREATES = [
    {"sha256": "f" * 64, "size": 10, "filename": "a.tar.zst"},
    {"sha256": "F" * 64, "size": "10", "filename": "../a"},
    {"size": 0},
    {"sha256": "0" * 64, "size": 1, "filename": "b", "node": "n" * 300},
]


def answers(serializer_class: type[serializers.Serializer], payloads: list) -> list:
    out = []
    for payload in payloads:
        serializer = serializer_class(data=payload)
        out.append(serializer.validated_data if serializer.is_valid() else serializer.errors)
    return out


def _extend_with_answers(out: list, serializer_class: type[serializers.Serializer], payloads: list) -> None:
    out.extend(answers(serializer_class, payloads))


def test_serializers_with_fields_built_once_answer_every_request_as_stock_drf_does():
    for serializer_class, payloads in ((HeartbeatSerializer, HEARTBEATS), (UploadCreateSerializer, CREATES)):
        expected = answers(plain(serializer_class), payloads)
        # Twice over on this thread (the fields are reused from the second instance on), and on another thread.
        assert answers(serializer_class, payloads + payloads) == expected + expected
        elsewhere: list = []
        thread = threading.Thread(target=_extend_with_answers, args=(elsewhere, serializer_class, payloads[::-1]))
        thread.start()
        thread.join()
        assert elsewhere == expected[::-1]


@pytest.mark.django_db(transaction=True)
def test_a_prepared_statement_whose_table_changed_shape_fails_once_not_until_restart(personas):
    # A migration that changes a column's type while servers run makes their prepared statements fail ("cached
    # plan must not change result type"); in autocommit nothing rolls back, so without care every later run on
    # that pooled connection failed the same way.
    if connection.vendor != "postgresql":
        pytest.skip("prepared statements are PostgreSQL's (COMMINSIGHT_DB_PREPARE_THRESHOLD)")
    workload = Workload.objects.create(owner=personas.alice, external_id="job-shape", name="job-shape")
    for _ in range(8):  # past the threshold: prepared
        assert rows.select_one(Workload, "t.id = %s", [workload.pk]).name == "job-shape"
    table, column = Workload._meta.db_table, Workload._meta.get_field("name").column
    with connection.cursor() as cursor:
        cursor.execute(f'ALTER TABLE "{table}" ALTER COLUMN "{column}" TYPE text')
    try:
        with pytest.raises(NotSupportedError, match="cached plan"):
            rows.select_one(Workload, "t.id = %s", [workload.pk])
        assert rows.select_one(Workload, "t.id = %s", [workload.pk]).name == "job-shape"
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f'ALTER TABLE "{table}" ALTER COLUMN "{column}" TYPE varchar(200)')
