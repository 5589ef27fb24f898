"""Hostile JSON everywhere it enters the site: API bodies answer 400 (413 when too large) with a reason,
archives are quarantined with a reason, and an archive that keeps failing ends quarantined after a bounded
number of attempts whatever the exception (the count survives the failed attempt)."""

from __future__ import annotations

import json

import pytest

from apps.workloads import ingest
from apps.workloads.models import Archive, ArchiveState
from tests.site.archives import manifest_entry, manifest_for, regular, segment_bytes, tar_zst, valid_archive
from tests.site.test_ingest_archives import register

DEEP = b"[" * 200_000 + b"]" * 200_000


def routes(personas) -> list[tuple[str, str]]:
    return [
        ("agent", "/api/v1/ingest/live/"),
        ("alice", "/api/v1/agent-tokens/"),
        ("alice", f"/api/v1/workloads/{personas.workload.pk}/shares/"),
        ("agent", "/api/v1/ingest/uploads/"),
    ]


@pytest.mark.parametrize("route", range(4))
def test_a_body_nested_200000_deep_is_a_400_with_a_reason(personas, alice, agent, route):
    who, url = routes(personas)[route]
    response = {"alice": alice, "agent": agent}[who].post(url, DEEP, content_type="application/json")
    assert response.status_code == 400
    assert response.json() == {"detail": "request body nests deeper than 32 levels"}


def test_a_body_nested_just_past_the_limit_is_refused_and_one_within_it_is_parsed(personas, alice):
    url = f"/api/v1/workloads/{personas.workload.pk}/shares/"
    deep = '{"username": "carol", "level": "read", "x": ' + "[" * 32 + "]" * 32 + "}"
    assert alice.post(url, deep, content_type="application/json").status_code == 400
    within = '{"username": "carol", "level": "read", "x": ' + "[" * 30 + "]" * 30 + "}"
    assert alice.post(url, within, content_type="application/json").status_code == 201


def test_malformed_json_is_a_400_naming_the_problem(alice):
    response = alice.post("/api/v1/agent-tokens/", b'{"name": ', content_type="application/json")
    assert response.status_code == 400
    assert response.json()["detail"].startswith("request body is not valid JSON")


def test_a_body_larger_than_the_limit_is_a_413(alice, settings):
    settings.API_JSON_MAX_BYTES = 1000
    body = json.dumps({"name": "x" * 2000})
    response = alice.post("/api/v1/agent-tokens/", body, content_type="application/json")
    assert response.status_code == 413
    assert response.json() == {"detail": "request body is larger than 1000 bytes"}


def archive_with_manifest_bytes(tmp_path, raw_manifest: bytes, members: list[tuple[str, bytes]]):
    return tar_zst(
        tmp_path / "ci-evil.tar.zst", [regular("manifest.json", raw_manifest), *(regular(*m) for m in members)]
    )


def manifest_bytes(members: list[tuple[str, bytes]], **override) -> bytes:
    entry = json.loads(manifest_entry(manifest_for(), members)[1])
    entry.update(override)
    return json.dumps(entry).encode()


def hostile_json_archive(tmp_path, kind: str):
    segment = [("segments/s0.cilog.sealed", segment_bytes(0))]
    if kind == "deep-manifest":
        raw = manifest_bytes(segment)
        return archive_with_manifest_bytes(tmp_path, raw[:-1] + b', "deep": ' + DEEP + b"}", segment)
    if kind == "deep-hang-member":
        members = [*segment, ("hang/timeout-0.json", DEEP)]
        return archive_with_manifest_bytes(tmp_path, manifest_bytes(members), members)
    if kind == "schema-version-true":
        return archive_with_manifest_bytes(tmp_path, manifest_bytes(segment, schema_version=True), segment)
    if kind == "dot-dot-member":
        members = [*segment, ("segments/..", b"x")]
        return archive_with_manifest_bytes(tmp_path, manifest_bytes(members), members)
    if kind == "size-true":
        raw = json.loads(manifest_bytes(segment))
        raw["members"][0]["size"] = True
        return archive_with_manifest_bytes(tmp_path, json.dumps(raw).encode(), segment)
    raise AssertionError(kind)


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("deep-manifest", "manifest.json nests deeper than 16 levels"),
        ("deep-hang-member", "hang/timeout-0.json nests deeper than 32 levels"),
        ("schema-version-true", "unsupported archive schema_version True"),
        ("dot-dot-member", "disallowed name: 'segments/..'"),
        ("size-true", "has an invalid size"),
    ],
)
def test_archives_with_hostile_json_are_quarantined_at_the_first_attempt(personas, tmp_path, kind, reason):
    archive = register(hostile_json_archive(tmp_path, kind), personas.alice)
    assert ingest.archive_ingest(archive.pk) == ArchiveState.QUARANTINED
    archive.refresh_from_db()
    assert reason in archive.reason
    assert archive.attempts == 1


def test_an_archive_failing_with_any_exception_is_quarantined_after_the_bounded_attempts(
    personas, tmp_path, monkeypatch, settings, alice
):
    settings.INGEST_MAX_ATTEMPTS = 3

    def overflow(archive):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(ingest, "stage_archive", overflow)
    archive = register(valid_archive(tmp_path), personas.alice)
    states = [ingest.archive_ingest(archive.pk) for _ in range(3)]
    assert states == [ArchiveState.STORED, ArchiveState.STORED, ArchiveState.QUARANTINED]
    archive.refresh_from_db()
    assert archive.attempts == 3
    assert archive.reason == (
        "ingest gave up after 3 attempts; the last: attempt 3 failed: RecursionError: maximum recursion depth exceeded"
    )
    assert ingest.archive_ingest(archive.pk) == ArchiveState.QUARANTINED  # and it stays so
    assert Archive.objects.get(pk=archive.pk).attempts == 3
    # Its owner sees why, in the API and on the workloads page.
    listed = alice.get("/api/v1/archives/?state=quarantined").json()
    assert [(a["id"], a["attempts"], a["reason"]) for a in listed] == [(archive.pk, 3, archive.reason)]
    assert b"RecursionError: maximum recursion depth exceeded" in alice.get("/workloads/").content


def test_a_failed_attempt_is_shown_while_the_archive_waits_for_the_next(personas, tmp_path, monkeypatch, alice):
    def broken(archive):
        raise MemoryError("no room")

    monkeypatch.setattr(ingest, "stage_archive", broken)
    archive = register(valid_archive(tmp_path), personas.alice)
    assert ingest.archive_ingest(archive.pk) == ArchiveState.STORED
    listed = alice.get("/api/v1/archives/?state=stored").json()
    assert [(a["attempts"], a["reason"]) for a in listed] == [(1, "attempt 1 failed: MemoryError: no room")]
    assert b"attempt 1 failed: MemoryError: no room" in alice.get("/workloads/").content


def test_an_archive_whose_worker_died_every_time_is_quarantined_by_the_requeue(personas, tmp_path, settings):
    from datetime import timedelta

    from django.utils import timezone

    from apps.workloads.tasks import requeue_stale_archives

    settings.INGEST_MAX_ATTEMPTS = 2
    archive = register(valid_archive(tmp_path), personas.alice)
    # Two attempts that never came back (killed): counted, their leases ran out.
    expired = timezone.now() - timedelta(seconds=1)
    Archive.objects.filter(pk=archive.pk).update(attempts=2, lease_owner="dead", lease_until=expired)
    assert requeue_stale_archives() == 1
    archive.refresh_from_db()
    assert archive.state == ArchiveState.QUARANTINED
    assert "gave up after 2 attempts" in archive.reason
    assert "stopped every time" in archive.reason


def test_the_archive_list_shows_only_your_own_archives(personas, tmp_path, client):
    archive = register(valid_archive(tmp_path), personas.alice)
    client.force_login(personas.carol)
    assert client.get("/api/v1/archives/").json() == []
    client.force_login(personas.admin)
    assert [a["id"] for a in client.get("/api/v1/archives/").json()] == [archive.pk]
    assert client.get("/api/v1/archives/?state=nonsense").status_code == 400


@pytest.mark.parametrize(
    ("field", "value"),
    [("finished", "yes"), ("finished", 1), ("node", 0), ("workload_id", ["job"]), ("sent_ns", "12"), ("sent_ns", 1.5)],
)
def test_a_heartbeat_field_of_the_wrong_type_is_refused_naming_it(agent, field, value):
    body = {"workload_id": "job-1", "node": "10.0.0.1", "sent_ns": 1, field: value}
    response = agent.post("/api/v1/ingest/live/", body, content_type="application/json")
    assert response.status_code == 400
    assert list(response.json()) == [field]


@pytest.mark.parametrize("path", ["/api/v1/workloads/", "/api/v1/users/", "/workloads/", "/api/v1/ingest/live/"])
@pytest.mark.parametrize("method", ["TRACE", "CONNECT", "BREW"])
def test_trace_and_unknown_methods_answer_405_in_json(alice, path, method):
    response = alice.generic(method, path)
    assert response.status_code == 405
    assert response.json() == {"detail": f'Method "{method}" not allowed.'}


def test_a_method_a_view_lacks_is_405_even_where_the_view_hides_itself(alice):
    # /api/v1/users/ is a 404 for alice (not an administrator), but PUT is not a method it has at all.
    assert alice.put("/api/v1/users/", {}, content_type="application/json").status_code == 405
    assert alice.get("/api/v1/users/").status_code == 404


def test_an_unknown_api_path_is_a_json_404(alice):
    response = alice.get("/api/v1/no-such-thing/")
    assert response.status_code == 404
    assert response.json() == {"detail": "Not found."}


def test_forms_are_not_taken_where_the_api_documents_json(alice):
    response = alice.post("/api/v1/agent-tokens/", {"name": "pool"})  # multipart, as a form would send
    assert response.status_code == 415


def test_in_the_embedded_mode_a_deeply_nested_archive_is_stored_then_quarantined_not_a_500(
    personas, agent, tmp_path, django_capture_on_commit_callbacks
):
    """Without a broker the ingest runs inside the upload's request (eager tasks): it must still end in a
    quarantine with a reason, and the upload in a 201."""
    from tests.site.archives import sha256_of

    path = hostile_json_archive(tmp_path, "deep-manifest")
    with django_capture_on_commit_callbacks(execute=True), path.open("rb") as handle:
        response = agent.post("/api/v1/ingest/archives/", {"file": handle, "sha256": sha256_of(path)})
    assert response.status_code == 201
    archive = Archive.objects.get(pk=response.json()["archive_id"])
    assert archive.state == ArchiveState.QUARANTINED
    assert archive.reason == "manifest.json nests deeper than 16 levels"
