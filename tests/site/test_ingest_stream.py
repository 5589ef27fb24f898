"""Upload chunks streamed to disk ahead of Django (apps.workloads.api.stream): the same answers as the view."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

import pytest
from asgiref.sync import sync_to_async
from django.core.cache import cache
from django.test import Client
from django.urls import reverse

from apps.workloads import uploads
from apps.workloads.api.stream import UploadChunkApp
from apps.workloads.models import Upload
from tests.site.archives import sha256_of, valid_archive
from tests.site.asgi_requests import answer, asgi_request


class Inner:
    """Stands for Django behind the chunk route: records what it was handed."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    async def __call__(self, scope, receive, send) -> None:
        self.paths.append(scope["path"])
        await send({"type": "http.response.start", "status": 299, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def app(inner=None) -> UploadChunkApp:
    # Synchronous parts run on the test's thread, inside its database transaction.
    return UploadChunkApp(inner or Inner(), run_sync=lambda fn: sync_to_async(fn, thread_sensitive=True))


def call(application, method: str, path: str, headers: dict[str, str], pieces: list[bytes], disconnect=False):
    """Drive one request through the ASGI app: the body in ``pieces``; (status, headers, JSON or None)."""
    messages = [{"type": "http.request", "body": p, "more_body": True} for p in pieces]
    if disconnect:
        messages.append({"type": "http.disconnect"})
    else:
        messages.append({"type": "http.request", "body": b"", "more_body": False})
    status, raw, body = answer(asgi_request(application, method, path, headers, messages))
    return status, dict(raw), (json.loads(body) if body else None)


def chunk_headers(secret: str, offset: int, data: bytes, checksum: str | None = None) -> dict[str, str]:
    return {
        "authorization": f"Bearer {secret}",
        "upload-offset": str(offset),
        "upload-checksum": f"sha256 {checksum or hashlib.sha256(data).hexdigest()}",
        "content-length": str(len(data)),
        "content-type": "application/offset+octet-stream",
    }


@pytest.fixture
def archive_file(tmp_path) -> Path:
    return valid_archive(tmp_path)


def open_upload(secret: str, path: Path) -> str:
    body = {"sha256": sha256_of(path), "size": path.stat().st_size, "filename": path.name}
    client = Client(HTTP_AUTHORIZATION=f"Bearer {secret}")
    return client.post(reverse("api-ingest-uploads"), body, content_type="application/json").json()["upload_id"]


def route(upload_id: str) -> str:
    return reverse("api-ingest-upload", args=[upload_id])


def test_a_chunk_streamed_in_many_pieces_is_appended_whole_and_finalizes(personas, archive_file):
    data = archive_file.read_bytes()
    upload_id = open_upload(personas.agent_secret, archive_file)
    pieces = [data[i : i + 97] for i in range(0, len(data), 97)]
    status, headers, _ = call(app(), "PATCH", route(upload_id), chunk_headers(personas.agent_secret, 0, data), pieces)
    assert status == 204
    assert headers[b"upload-offset"] == str(len(data)).encode()
    assert Upload.objects.get(pk=upload_id).offset == len(data)
    assert uploads.part_path(Upload.objects.get(pk=upload_id)).read_bytes() == data
    finalized = Client(HTTP_AUTHORIZATION=f"Bearer {personas.agent_secret}").post(
        reverse("api-ingest-upload-finalize", args=[upload_id])
    )
    assert finalized.status_code == 201


def refusal_cases(personas, data: bytes, whole: bytes) -> dict[str, tuple[dict[str, str], bytes]]:
    """Requests that must be refused, each with its headers and body (``data`` a prefix of ``whole``)."""
    good = chunk_headers(personas.agent_secret, 0, data)
    too_long = whole + b"x"
    return {
        "no token": ({k: v for k, v in good.items() if k != "authorization"}, data),
        "unknown token": ({**good, "authorization": "Bearer ci_nope_nope"}, data),
        "another owner's upload": (chunk_headers(personas.carol_agent_secret, 0, data), data),
        "wrong offset": (chunk_headers(personas.agent_secret, 5, data), data),
        "offset not a number": ({**good, "upload-offset": "five"}, data),
        "no checksum header": ({k: v for k, v in good.items() if k != "upload-checksum"}, data),
        "wrong checksum": (chunk_headers(personas.agent_secret, 0, data, checksum="0" * 64), data),
        "past the declared size": (chunk_headers(personas.agent_secret, 0, too_long), too_long),
        "empty chunk": (chunk_headers(personas.agent_secret, 0, b""), b""),
        "body shorter than announced": ({**good, "content-length": str(len(data) + 10)}, data),
    }


def view_answer(headers: dict[str, str], body: bytes, path: str):
    meta = {f"HTTP_{k.upper().replace('-', '_')}": v for k, v in headers.items() if k not in ("content-length",)}
    meta.pop("HTTP_CONTENT_TYPE", None)
    meta["CONTENT_LENGTH"] = headers.get("content-length", "0")
    response = Client().generic("PATCH", path, data=body, content_type="application/offset+octet-stream", **meta)
    return response.status_code, response.json()


def test_every_refusal_matches_the_django_view_and_writes_nothing(personas, archive_file):
    whole = archive_file.read_bytes()
    upload_id = open_upload(personas.agent_secret, archive_file)
    part = uploads.part_path(Upload.objects.get(pk=upload_id))
    for case, (headers, body) in refusal_cases(personas, whole[:1000], whole).items():
        status, _, answer = call(app(), "PATCH", route(upload_id), headers, [body] if body else [])
        if case == "body shorter than announced":
            # The view reads a truncated body from Django's spool; both name the shortfall.
            assert status == 400, case
            assert "body ended after" in answer["detail"], case
        else:
            assert (status, answer) == view_answer(headers, body, route(upload_id)), case
        assert part.stat().st_size == 0, case
        assert Upload.objects.get(pk=upload_id).offset == 0, case


def test_a_client_that_goes_away_mid_chunk_appends_nothing(personas, archive_file):
    data = archive_file.read_bytes()
    upload_id = open_upload(personas.agent_secret, archive_file)
    headers = chunk_headers(personas.agent_secret, 0, data)
    status, _, _ = call(app(), "PATCH", route(upload_id), headers, [data[:500]], disconnect=True)
    assert status is None
    assert uploads.part_path(Upload.objects.get(pk=upload_id)).stat().st_size == 0
    status, _, _ = call(app(), "PATCH", route(upload_id), headers, [data])
    assert status == 204


def test_over_the_rate_the_agent_is_told_to_wait(personas, archive_file, settings):
    from rest_framework.settings import api_settings
    from rest_framework.throttling import ScopedRateThrottle

    cache.clear()
    rates = {**api_settings.DEFAULT_THROTTLE_RATES, "ingest": "2/min"}  # the create and one chunk
    ScopedRateThrottle.THROTTLE_RATES, saved = rates, ScopedRateThrottle.THROTTLE_RATES
    try:
        data = archive_file.read_bytes()[:100]
        upload_id = open_upload(personas.agent_secret, archive_file)
        first = call(app(), "PATCH", route(upload_id), chunk_headers(personas.agent_secret, 0, data), [data])
        second = call(app(), "PATCH", route(upload_id), chunk_headers(personas.agent_secret, 100, data), [data])
    finally:
        ScopedRateThrottle.THROTTLE_RATES = saved
        cache.clear()
    assert first[0] == 204
    assert second[0] == 429
    assert b"retry-after" in second[1]
    assert Upload.objects.get(pk=upload_id).offset == 100


def test_a_full_disk_answers_507_with_a_reason_and_keeps_nothing(personas, archive_file, monkeypatch):
    data = archive_file.read_bytes()
    upload_id = open_upload(personas.agent_secret, archive_file)
    real_pwrite = os.pwrite
    calls = []

    def pwrite_until_full(fd, block, offset):
        calls.append(offset)
        if len(calls) > 2:
            raise OSError(28, "No space left on device")
        return real_pwrite(fd, block, offset)

    monkeypatch.setattr(os, "pwrite", pwrite_until_full)
    pieces = [data[i : i + 100] for i in range(0, len(data), 100)]
    status, _, answer = call(app(), "PATCH", route(upload_id), chunk_headers(personas.agent_secret, 0, data), pieces)
    monkeypatch.undo()
    assert status == 507
    assert answer["reason"] == "disk full"
    part = uploads.part_path(Upload.objects.get(pk=upload_id))
    assert part.stat().st_size == 0
    assert not [fd for fd in os.listdir("/proc/self/fd") if os.path.realpath(f"/proc/self/fd/{fd}") == str(part)]


def test_other_routes_and_methods_go_to_django(personas):
    inner = Inner()
    application = app(inner)
    upload_route = route("12345678-1234-4234-8234-123456789abc")
    for method, path in [("GET", "/healthz"), ("HEAD", upload_route), ("POST", reverse("api-ingest-uploads"))]:
        status, _, _ = call(application, method, path, {}, [])
        assert status == 299
    assert inner.paths == ["/healthz", upload_route, reverse("api-ingest-uploads")]


def test_with_a_separate_agent_listener_chunks_on_the_browser_port_go_to_django(personas, settings):
    settings.SERVER_AGENT_LISTEN = "127.0.0.1:9000"  # the test scope arrives on port 8000
    inner = Inner()
    status, _, _ = call(app(inner), "PATCH", route("12345678-1234-4234-8234-123456789abc"), {}, [])
    assert status == 299


def test_a_chunk_with_a_token_revoked_since_the_last_one_is_refused_and_writes_nothing(personas, archive_file):
    from apps.accounts.services import agent_token_revoke

    data = archive_file.read_bytes()
    upload_id = open_upload(personas.agent_secret, archive_file)
    first = data[:1000]
    assert call(app(), "PATCH", route(upload_id), chunk_headers(personas.agent_secret, 0, first), [first])[0] == 204
    agent_token_revoke(actor=personas.alice, token=personas.agent_token)
    rest = data[1000:]
    headers = chunk_headers(personas.agent_secret, 1000, rest)
    status, _, answer = call(app(), "PATCH", route(upload_id), headers, [rest])
    assert (status, answer) == (401, {"detail": "Unknown or revoked agent token."})
    assert (status, answer) == view_answer(headers, rest, route(upload_id))
    assert uploads.part_path(Upload.objects.get(pk=upload_id)).read_bytes() == first


def test_a_chunk_through_a_proxy_is_judged_by_the_forwarded_host_as_django_does(personas, archive_file, settings):
    settings.USE_X_FORWARDED_HOST = True
    settings.ALLOWED_HOSTS = ["ingest.example"]
    data = archive_file.read_bytes()[:1000]
    upload_id = Upload.objects.create(
        id=uuid.uuid4(), token=personas.agent_token, owner=personas.alice, sha256="0" * 64, size=5000, filename="a"
    ).pk
    uploads.part_path(Upload.objects.get(pk=upload_id)).touch()
    refused = {**chunk_headers(personas.agent_secret, 0, data), "host": "ingest.example", "x-forwarded-host": "x.io"}
    assert call(app(), "PATCH", route(str(upload_id)), refused, [data])[0] == 400
    meta = {"HTTP_HOST": "ingest.example", "HTTP_X_FORWARDED_HOST": "x.io"}
    assert Client().generic("PATCH", route(str(upload_id)), data=data, **meta).status_code == 400  # Django's view
    assert uploads.part_path(Upload.objects.get(pk=upload_id)).stat().st_size == 0
    allowed = {**refused, "host": "internal", "x-forwarded-host": "ingest.example"}
    assert call(app(), "PATCH", route(str(upload_id)), allowed, [data])[0] == 204
