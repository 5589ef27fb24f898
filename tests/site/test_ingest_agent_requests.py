"""Upload create, upload HEAD and heartbeats answered ahead of Django (apps.workloads.api.agent_requests):
the same answers as the API views, and whatever this path does not take reaches Django untouched."""

from __future__ import annotations

import hashlib
import json

import pytest
from asgiref.sync import sync_to_async
from django.core.cache import cache
from django.test import Client
from django.urls import reverse

from apps.workloads.api.agent_requests import AgentRequestsApp
from apps.workloads.models import Node, Upload, Workload
from tests.site.asgi_requests import answer, asgi_request

IGNORED_HEADERS = {"date", "server"}


class Inner:
    """Stands for Django behind this path: records each request handed to it, with its body."""

    def __init__(self) -> None:
        self.handed: list[tuple[str, str, bytes]] = []

    async def __call__(self, scope, receive, send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        self.handed.append((scope["method"], scope["path"], body))
        await send({"type": "http.response.start", "status": 299, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def app(inner=None) -> AgentRequestsApp:
    # Synchronous parts run on the test's thread, inside its database transaction.
    return AgentRequestsApp(inner or Inner(), run_sync=lambda fn: sync_to_async(fn, thread_sensitive=True))


def call(application, method: str, path: str, headers: dict[str, str], body: bytes = b"", query: bytes = b""):
    """One request through the ASGI app; (status, {header: value}, body bytes) or (None, {}, b"")."""
    messages = [{"type": "http.request", "body": body, "more_body": False}, {"type": "http.disconnect"}]
    status, raw, content = answer(asgi_request(application, method, path, headers, messages, query))
    return status, {k.decode().lower(): v.decode() for k, v in raw}, content


def django_answer(method: str, path: str, headers: dict[str, str], body: bytes = b""):
    """The API view's answer to the same request, through Django's test client (middlewares included)."""
    meta = {f"HTTP_{k.upper().replace('-', '_')}": v for k, v in headers.items() if k != "content-type"}
    response = Client().generic(method, path, data=body, content_type=headers.get("content-type", ""), **meta)
    answer_headers = {k.lower(): v for k, v in response.headers.items()}
    return response.status_code, answer_headers, response.content


def fast_answer(method: str, path: str, headers: dict[str, str], body: bytes = b""):
    inner = Inner()
    status, answer_headers, content = call(app(inner), method, path, headers, body)
    assert inner.handed == [], f"{method} {path} was handed to Django"
    return status, answer_headers, content


def json_request(secret: str, payload: object) -> tuple[dict[str, str], bytes]:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    headers = {"authorization": f"Bearer {secret}", "content-type": "application/json"}
    return {**headers, "content-length": str(len(body))}, body


def assert_same(fast, django, case: str) -> None:
    (fast_status, fast_headers, fast_body), (django_status, django_headers, django_body) = fast, django
    assert fast_status == django_status, case
    assert fast_body == django_body, case
    drop = IGNORED_HEADERS
    assert {k: v for k, v in fast_headers.items() if k not in drop} == {
        k: v for k, v in django_headers.items() if k not in drop
    }, case


CREATE = reverse("api-ingest-uploads")
LIVE = reverse("api-ingest-live")


def create_body(seed: str, size: int = 1000) -> dict:
    return {"sha256": hashlib.sha256(seed.encode()).hexdigest(), "size": size, "filename": "ci-n1-0-1.tar.zst"}


def test_a_new_upload_is_opened_like_the_view_opens_it(personas):
    headers, body = json_request(personas.agent_secret, create_body("fresh"))
    status, answer_headers, content = fast_answer("POST", CREATE, headers, body)
    assert status == 201
    opened = json.loads(content)
    upload = Upload.objects.get(pk=opened["upload_id"])
    assert (upload.owner, upload.offset, upload.size) == (personas.alice, 0, 1000)
    # The view answers a second create of the same bytes with this upload (resume): same answer both ways.
    assert_same(fast_answer("POST", CREATE, headers, body), django_answer("POST", CREATE, headers, body), "resume")
    assert json.loads(django_answer("POST", CREATE, headers, body)[2])["upload_id"] == opened["upload_id"]
    assert answer_headers["content-type"] == "application/json"


@pytest.mark.parametrize(
    ("case", "payload"),
    [
        ("sha256 not hex", {**create_body("x"), "sha256": "z" * 64}),
        ("size as a string", {**create_body("x"), "size": "1000"}),
        ("size zero", {**create_body("x"), "size": 0}),
        ("filename with a slash", {**create_body("x"), "filename": "../etc/passwd"}),
        ("missing fields", {"size": 10}),
        ("not an object", [1, 2, 3]),
        ("over the archive cap", create_body("huge", size=1 << 62)),
        ("not JSON", b"{'sha256':"),
        ("nested too deep", b"[" * 5000 + b"]" * 5000),
        ("not UTF-8", b'{"filename": "\xff\xfe"}'),
    ],
)
def test_a_refused_create_gets_the_views_answer_and_opens_nothing(personas, case, payload):
    headers, body = json_request(personas.agent_secret, payload)
    fast = fast_answer("POST", CREATE, headers, body)
    assert_same(fast, django_answer("POST", CREATE, headers, body), case)
    assert 400 <= fast[0] < 500, case
    assert not Upload.objects.exists(), case


def test_the_upload_offset_is_answered_like_the_view_answers_it(personas):
    headers, body = json_request(personas.agent_secret, create_body("head"))
    upload_id = json.loads(fast_answer("POST", CREATE, headers, body)[2])["upload_id"]
    Upload.objects.filter(pk=upload_id).update(offset=300)
    path = reverse("api-ingest-upload", args=[upload_id])
    auth = {"authorization": f"Bearer {personas.agent_secret}"}
    fast = fast_answer("HEAD", path, auth)
    assert fast[0] == 200
    assert (fast[1]["upload-offset"], fast[1]["upload-length"]) == ("300", "1000")
    assert_same(fast, django_answer("HEAD", path, auth), "open upload")
    # Another owner's upload, and one that does not exist, are the same 404.
    carol = {"authorization": f"Bearer {personas.carol_agent_secret}"}
    assert_same(fast_answer("HEAD", path, carol), django_answer("HEAD", path, carol), "carol asks")
    missing = reverse("api-ingest-upload", args=["12345678-1234-4234-8234-123456789abc"])
    assert_same(fast_answer("HEAD", missing, auth), django_answer("HEAD", missing, auth), "no such upload")
    assert fast_answer("HEAD", missing, auth)[0] == 404


def heartbeat(node: str, **extra) -> dict:
    return {"workload_id": "job-fast", "node": node, "sent_ns": 1, "communicators": [], **extra}


def test_a_heartbeat_is_recorded_and_answered_like_the_view_does(personas):
    headers, body = json_request(personas.agent_secret, heartbeat("n1", host="h1"))
    fast = fast_answer("POST", LIVE, headers, body)
    assert fast[0] == 202
    assert json.loads(fast[2]) == {"status": "running"}
    node = Node.objects.get(workload__external_id="job-fast", name="n1")
    assert (node.workload.owner, node.host) == (personas.alice, "h1")
    assert_same(fast, django_answer("POST", LIVE, headers, body), "second heartbeat")


@pytest.mark.parametrize(
    ("case", "payload"),
    [
        ("node not a string", heartbeat("n1") | {"node": 7}),
        ("finished not a boolean", heartbeat("n1", finished="yes")),
        ("communicator without a hash", heartbeat("n1", communicators=[{"nranks": 2}])),
        ("negative sent_ns", heartbeat("n1", sent_ns=-1)),
        ("not JSON", b'{"workload_id": "job-fast", '),
        ("a JSON string", b'"heartbeat"'),
    ],
)
def test_a_malformed_heartbeat_gets_the_views_answer_and_changes_nothing(personas, case, payload):
    headers, body = json_request(personas.agent_secret, payload)
    fast = fast_answer("POST", LIVE, headers, body)
    assert_same(fast, django_answer("POST", LIVE, headers, body), case)
    assert fast[0] == 400, case
    assert not Workload.objects.filter(external_id="job-fast").exists(), case


def test_an_oversized_heartbeat_is_refused_before_it_is_parsed(personas, settings):
    settings.INGEST_LIVE_MAX_BYTES = 200
    headers, body = json_request(personas.agent_secret, heartbeat("n1", host="h" * 300))
    fast = fast_answer("POST", LIVE, headers, body)
    assert fast[0] == 413
    assert_same(fast, django_answer("POST", LIVE, headers, body), "oversized")
    assert not Workload.objects.filter(external_id="job-fast").exists()


def test_over_the_rate_an_agent_is_told_to_wait_and_nothing_is_recorded(personas):
    from rest_framework.settings import api_settings
    from rest_framework.throttling import ScopedRateThrottle

    cache.clear()
    ScopedRateThrottle.THROTTLE_RATES, saved = (
        {**api_settings.DEFAULT_THROTTLE_RATES, "ingest": "1/min"},
        (ScopedRateThrottle.THROTTLE_RATES),
    )
    try:
        headers, body = json_request(personas.agent_secret, heartbeat("n1"))
        first = fast_answer("POST", LIVE, headers, body)
        headers, body = json_request(personas.agent_secret, heartbeat("n2"))
        second = fast_answer("POST", LIVE, headers, body)
    finally:
        ScopedRateThrottle.THROTTLE_RATES = saved
        cache.clear()
    assert first[0] == 202
    assert second[0] == 429
    assert "retry-after" in second[1]
    assert json.loads(second[2])["detail"].startswith("Request was throttled.")
    assert list(Node.objects.filter(workload__external_id="job-fast").values_list("name", flat=True)) == ["n1"]


def test_requests_this_path_does_not_answer_reach_django_with_their_body(personas):
    good_headers, good_body = json_request(personas.agent_secret, heartbeat("n1"))
    upload_path = reverse("api-ingest-upload", args=["12345678-1234-4234-8234-123456789abc"])
    cases = {
        "no token": ("POST", LIVE, {k: v for k, v in good_headers.items() if k != "authorization"}, good_body),
        "unknown token": ("POST", LIVE, {**good_headers, "authorization": "Bearer ci_nope_nope"}, good_body),
        "token not ASCII": ("POST", LIVE, {**good_headers, "authorization": "Bearer ci_\u00e9_x"}, good_body),
        "basic auth": ("POST", LIVE, {**good_headers, "authorization": "Basic YWxpY2U6eA=="}, good_body),
        "three-part authorization": ("POST", LIVE, {**good_headers, "authorization": "Bearer a b"}, good_body),
        "not JSON": ("POST", LIVE, {**good_headers, "content-type": "text/plain"}, good_body),
        "form body": ("POST", CREATE, {**good_headers, "content-type": "application/x-www-form-urlencoded"}, b"a=1"),
        "empty body": ("POST", CREATE, {**good_headers, "content-length": "0"}, b""),
        "no content-length": ("POST", LIVE, {k: v for k, v in good_headers.items() if k != "content-length"}, b""),
        "chunked": ("POST", LIVE, {**good_headers, "transfer-encoding": "chunked"}, good_body),
        "XML wanted": ("POST", LIVE, {**good_headers, "accept": "application/xml"}, good_body),
        "indented JSON wanted": ("POST", LIVE, {**good_headers, "accept": "application/json; indent=4"}, good_body),
        "host not allowed": ("POST", LIVE, {**good_headers, "host": "evil.example"}, good_body),
        "GET on an upload": ("GET", upload_path, {"authorization": good_headers["authorization"]}, b""),
        "DELETE on the create route": ("DELETE", CREATE, {"authorization": good_headers["authorization"]}, b""),
    }
    for case, (method, path, headers, body) in cases.items():
        inner = Inner()
        status, _, _ = call(app(inner), method, path, headers, body)
        assert status == 299, case
        assert inner.handed == [(method, path, body)], case
    inner = Inner()
    assert call(app(inner), "POST", LIVE, good_headers, good_body, query=b"format=api")[0] == 299
    assert not Workload.objects.filter(external_id="job-fast").exists()


def test_a_refused_token_gets_djangos_own_answer(personas):
    headers, body = json_request("ci_nope_nope", heartbeat("n1"))
    status, answer_headers, _ = django_answer("POST", LIVE, headers, body)
    assert status == 401
    assert answer_headers["www-authenticate"] == 'Bearer realm="comminsight-ingest"'


def test_with_a_separate_agent_listener_requests_on_the_browser_port_go_to_django(personas, settings):
    settings.SERVER_AGENT_LISTEN = "127.0.0.1:9000"  # the test scope arrives on port 8000
    inner = Inner()
    headers, body = json_request(personas.agent_secret, heartbeat("n1"))
    assert call(app(inner), "POST", LIVE, headers, body)[0] == 299
    assert inner.handed == [("POST", LIVE, body)]


def test_a_client_that_goes_away_before_its_body_arrived_records_nothing(personas):
    headers, body = json_request(personas.agent_secret, heartbeat("n1"))
    messages = [{"type": "http.request", "body": body[:10], "more_body": True}, {"type": "http.disconnect"}]
    sent = asgi_request(app(), "POST", LIVE, headers, messages)
    assert sent == []
    assert not Workload.objects.filter(external_id="job-fast").exists()


def test_a_revoked_token_stops_working_at_the_next_request(personas):
    from apps.accounts.services import agent_token_revoke

    headers, body = json_request(personas.agent_secret, heartbeat("n1"))
    assert fast_answer("POST", LIVE, headers, body)[0] == 202
    agent_token_revoke(actor=personas.alice, token=personas.agent_token)
    # Nothing about the token is kept between requests: the very next one is Django's to refuse, and it does.
    headers, body = json_request(personas.agent_secret, heartbeat("n2"))
    inner = Inner()
    assert call(app(inner), "POST", LIVE, headers, body)[0] == 299
    assert inner.handed == [("POST", LIVE, body)]
    status, _, content = django_answer("POST", LIVE, headers, body)
    assert (status, json.loads(content)["detail"]) == (401, "Unknown or revoked agent token.")
    assert not Node.objects.filter(name="n2").exists()


def test_a_deactivated_owners_token_stops_working_at_the_next_request(personas):
    headers, body = json_request(personas.agent_secret, create_body("owner-leaves"))
    assert fast_answer("POST", CREATE, headers, body)[0] == 201
    personas.alice.is_active = False
    personas.alice.save(update_fields=["is_active"])
    inner = Inner()
    assert call(app(inner), "POST", CREATE, headers, body)[0] == 299
    assert django_answer("POST", CREATE, headers, body)[0] == 401


def test_over_https_behind_a_proxy_the_answer_carries_djangos_security_headers(personas, settings):
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    settings.SECURE_HSTS_SECONDS = 3600
    settings.SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    settings.SECURE_REFERRER_POLICY = "no-referrer"
    headers, body = json_request(personas.agent_secret, heartbeat("n1"))
    headers["x-forwarded-proto"] = "https"
    fast = fast_answer("POST", LIVE, headers, body)
    assert fast[1]["strict-transport-security"] == "max-age=3600; includeSubDomains"
    assert fast[1]["referrer-policy"] == "no-referrer"
    assert_same(fast, django_answer("POST", LIVE, headers, body), "https")
    # Over plain http (the proxy says so) there is no HSTS header, on either path.
    headers["x-forwarded-proto"] = "http"
    plain = fast_answer("POST", LIVE, headers, body)
    assert "strict-transport-security" not in plain[1]
    assert_same(plain, django_answer("POST", LIVE, headers, body), "http behind the proxy")


def test_a_forwarded_host_is_judged_as_django_judges_it(personas, settings):
    settings.USE_X_FORWARDED_HOST = True
    settings.ALLOWED_HOSTS = ["ingest.example"]
    headers, body = json_request(personas.agent_secret, heartbeat("n1"))
    allowed = {**headers, "host": "internal:8000", "x-forwarded-host": "ingest.example"}
    assert_same(fast_answer("POST", LIVE, allowed, body), django_answer("POST", LIVE, allowed, body), "allowed")
    refused = {**headers, "host": "ingest.example", "x-forwarded-host": "evil.example"}
    inner = Inner()
    assert call(app(inner), "POST", LIVE, refused, body)[0] == 299
    assert django_answer("POST", LIVE, refused, body)[0] == 400
