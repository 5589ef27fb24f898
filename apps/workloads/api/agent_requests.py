"""The agents' frequent small requests as an ASGI application ahead of Django: upload create
(``POST /api/v1/ingest/uploads/``), upload offset (``HEAD /api/v1/ingest/uploads/<id>/``) and heartbeat
(``POST /api/v1/ingest/live/``).

Through Django each of these paid for the whole request machinery — eleven middlewares, a new thread per
request for the sync view (asgiref's per-request executor) and DRF's negotiation — several times the cost
of the database work itself. Here a request costs one hop to the thread pool, where the API view's own
pieces run in the view's order: allowed host, agent listener, agent token (``agent_token_authenticate``),
ingest scope, rate (``IngestRateThrottle``), the view's size check, the API's bounded JSON parser, the
view's serializer, then the same ``uploads``/``live`` function. Answers are rendered by DRF's
``JSONRenderer`` with the headers Django's middlewares add, so agents cannot tell the two paths apart
(``tests/site/test_ingest_agent_requests.py`` compares every answer with the view's).

Whatever this path does not answer itself goes to Django untouched, body included, and Django gives its
usual answer: every request before authentication succeeded (no or unknown token, wrong scope, a host or
scheme Django would refuse or redirect), and every request shaped unlike an agent's (a query string, an
``Accept`` other than JSON, a body without ``Content-Length`` or one that is not JSON, a body too large
to hold). Nothing has been counted or changed when a request is handed over.
"""

from __future__ import annotations

import io
import re
import uuid
from collections.abc import Awaitable, Callable
from functools import cache
from typing import Any

from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver
from django.http import HttpRequest, HttpResponse
from django.middleware.clickjacking import XFrameOptionsMiddleware
from django.middleware.security import SecurityMiddleware
from rest_framework import exceptions
from rest_framework.renderers import JSONRenderer

from apps.accounts.authentication import MalformedBearer, bearer_credential
from apps.accounts.middleware import INGEST_PREFIX
from apps.accounts.models import AgentToken, AgentTokenScope
from apps.accounts.services import agent_token_authenticate
from apps.workloads import live, uploads
from apps.workloads.models import Workload
from comminsight_site.parsers import BoundedJSONParser

from . import ingest
from .stream import Receive, Scope, Send, UploadChunkApp, _in_pool, host_allowed, throttle_wait

UPLOAD_ROUTE = re.compile(
    "^" + re.escape(INGEST_PREFIX) + r"uploads/([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})/$"
)
CREATE_PATH = INGEST_PREFIX + "uploads/"
LIVE_PATH = INGEST_PREFIX + "live/"
# What an agent sends as Accept (httpx: */*); anything else is DRF's content negotiation, left to Django.
PLAIN_ACCEPT = ("", "*/*", "application/json")


class Delegate(Exception):
    """This request is Django's to answer (nothing was counted or changed)."""


class Answer:
    """A response: status, JSON data (or None for an empty body), extra headers; for a stored heartbeat, the
    workload as it left it (id, status, summary), told to open pages once the answer is sent."""

    __slots__ = ("data", "headers", "status", "workload")

    def __init__(self, status: int, data: Any = None, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        self.status, self.data, self.headers = status, data, headers or []
        self.workload: tuple[int, str, Any] | None = None


# Heartbeats tell open pages from the event loop, coalesced per workload (live.HeartbeatPublisher).
PUBLISHER = live.HeartbeatPublisher()


def _allow(view: type) -> bytes:
    """The ``Allow`` header DRF sends with every answer of ``view``."""
    return ", ".join(view().allowed_methods).encode()


ALLOW = {
    "create": _allow(ingest.UploadCreateView),
    "head": _allow(ingest.UploadDetailView),
    "live": _allow(ingest.LiveView),
}


def middleware_headers(scheme: str) -> list[tuple[bytes, bytes]]:
    """The headers Django's middlewares add to an API answer on ``scheme``: those ``SecurityMiddleware`` and
    ``XFrameOptionsMiddleware`` put on an empty response, computed by the middlewares themselves once per
    scheme (again after a settings change), so the two paths cannot drift apart."""
    return list(_middleware_headers(scheme))


class _Probe(HttpRequest):
    """A request as the middlewares see it, on ``scheme`` (no proxy header: the scheme is already decided)."""

    def __init__(self, scheme: str) -> None:
        super().__init__()
        self._probe_scheme = scheme

    def _get_scheme(self) -> str:
        return self._probe_scheme


@cache
def _middleware_headers(scheme: str) -> tuple[tuple[bytes, bytes], ...]:
    request, response = _Probe(scheme), HttpResponse()
    before = set(response.headers)
    for middleware in (SecurityMiddleware, XFrameOptionsMiddleware):
        response = middleware(HttpResponse).process_response(request, response)  # get_response: never called
    return tuple(
        (name.lower().encode("latin-1"), value.encode("latin-1"))
        for name, value in response.headers.items()
        if name not in before
    )


@receiver(setting_changed)
def _settings_changed(**kwargs: Any) -> None:
    _middleware_headers.cache_clear()


class AgentRequestsApp:
    """ASGI: answers upload create, upload HEAD and heartbeats; passes every other request to ``app``."""

    def __init__(self, app: Any, run_sync: Callable[[Callable[..., Any]], Callable[..., Awaitable[Any]]] = _in_pool):
        self.app = app
        self.run_sync = run_sync

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind, upload_id = _route(scope)
        if kind is None or not UploadChunkApp._on_agent_listener(scope) or scope.get("query_string"):
            await self.app(scope, receive, send)
            return
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        scheme = _scheme(scope, headers)
        if scheme is None or headers.get("accept", "").strip() not in PLAIN_ACCEPT:
            await self.app(scope, receive, send)
            return
        body = b""
        if kind != "head":
            read = await _read_json_body(headers, receive)
            if read is None:  # the client went away
                return
            if isinstance(read, Delegate):
                await self.app(scope, receive, send)
                return
            body = read
        try:
            answer = await self.run_sync(_answer)(kind, headers, body, upload_id)
        except Delegate:
            await self.app(scope, _replay(body, receive), send)
            return
        await _respond(send, answer, [(b"allow", ALLOW[kind]), *middleware_headers(scheme)])
        if answer.workload is not None:
            await PUBLISHER.heartbeat(*answer.workload)


def _route(scope: Scope) -> tuple[str | None, uuid.UUID | None]:
    if scope["type"] != "http":
        return None, None
    path, method = scope.get("path", ""), scope["method"]
    if method == "POST" and path == CREATE_PATH:
        return "create", None
    if method == "POST" and path == LIVE_PATH:
        return "live", None
    if method == "HEAD" and (match := UPLOAD_ROUTE.match(path)):
        return "head", uuid.UUID(match.group(1))
    return None, None


def _scheme(scope: Scope, headers: dict[str, str]) -> str | None:
    """The scheme Django would see (``SECURE_PROXY_SSL_HEADER``); None where Django would redirect to https."""
    scheme = scope.get("scheme", "http")
    if settings.SECURE_PROXY_SSL_HEADER:
        header, secure_value = settings.SECURE_PROXY_SSL_HEADER
        forwarded = headers.get(header.removeprefix("HTTP_").replace("_", "-").lower())
        if forwarded is not None:
            scheme = "https" if forwarded.split(",", 1)[0].strip() == secure_value else "http"
    if settings.SECURE_SSL_REDIRECT and scheme != "https":
        return None
    return scheme


async def _read_json_body(headers: dict[str, str], receive: Receive) -> bytes | Delegate | None:
    """A JSON body of announced length within the API's limit; Delegate if the request is not like that.

    The body is read only when the request qualifies, so a handed-over request still has all of it."""
    content_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    length = headers.get("content-length", "")
    if content_type != "application/json" or not length.isdigit() or "transfer-encoding" in headers:
        return Delegate()
    if not 0 < int(length) <= settings.API_JSON_MAX_BYTES:  # DRF reads an empty body as {}: Django's case
        return Delegate()
    pieces: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        pieces.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(pieces)


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` for Django after the body was read here: the body once, then the connection's own."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> dict[str, Any]:
        return pending.pop() if pending else await receive()

    return replay


def _authenticated(headers: dict[str, str]) -> AgentToken:
    """The agent token as the API view authenticates and permits it; anything else is Django's to refuse."""
    if not host_allowed(headers):
        raise Delegate
    try:
        presented = bearer_credential(headers.get("authorization", "").encode("latin-1"))
    except MalformedBearer:
        raise Delegate from None
    token = None if presented is None else agent_token_authenticate(presented)
    if token is None or token.scope != AgentTokenScope.INGEST:
        raise Delegate
    return token


def _answer(kind: str, headers: dict[str, str], body: bytes, upload_id: uuid.UUID | None) -> Answer:
    """The view's answer, computed with the view's checks in the view's order (runs in the thread pool)."""
    token = _authenticated(headers)
    wait = throttle_wait(token.owner)
    if wait is not False:
        retry = [(b"retry-after", str(int(wait)).encode())] if wait is not None else []
        return Answer(429, {"detail": exceptions.Throttled(wait).detail}, retry)
    try:
        if kind == "head":
            return _head(token, upload_id)
        if kind == "live" and int(headers["content-length"]) > settings.INGEST_LIVE_MAX_BYTES:
            return Answer(413, {"detail": "heartbeat too large"})
        data = BoundedJSONParser().parse(io.BytesIO(body))
        return _create(token, data) if kind == "create" else _heartbeat(token, data)
    except exceptions.APIException as exc:  # DRF's exception handler, for the exceptions these steps raise
        detail = exc.detail if isinstance(exc.detail, (list, dict)) else {"detail": exc.detail}
        return Answer(exc.status_code, detail)


def _head(token: AgentToken, upload_id: uuid.UUID | None) -> Answer:
    upload = uploads.upload_get(owner=token.owner, upload_id=upload_id)
    if upload is None:
        return Answer(404)
    offset = [(b"upload-offset", str(upload.offset).encode()), (b"upload-length", str(upload.size).encode())]
    return Answer(200, None, [*offset, (b"cache-control", b"no-store")])


def _create(token: AgentToken, data: Any) -> Answer:
    body = ingest.UploadCreateSerializer(data=data)
    body.is_valid(raise_exception=True)
    try:
        outcome = uploads.upload_create(token=token, **body.validated_data)
    except uploads.UploadError as exc:
        return Answer(exc.status, {"detail": exc.detail, **exc.extra})
    if outcome.archive is not None:
        return Answer(200, ingest.complete_body(outcome.archive))
    return Answer(201 if outcome.created else 200, ingest.open_body(outcome.upload))


def _heartbeat(token: AgentToken, data: Any) -> Answer:
    body = ingest.HeartbeatSerializer(data=data)
    body.is_valid(raise_exception=True)
    stored: list[Workload] = []
    workload = live.live_record_heartbeat(token=token, heartbeat=body.validated_data, publish=stored.append)
    answer = Answer(202, {"status": workload.status})
    if stored:  # committed (each statement commits on its own; a caller's transaction would defer it)
        answer.workload = (workload.pk, workload.status, workload.live_summary)
    return answer


RENDERER = JSONRenderer()


async def _respond(send: Send, answer: Answer, headers: list[tuple[bytes, bytes]]) -> None:
    payload = RENDERER.render(answer.data)
    response_headers = [*answer.headers, *headers, (b"content-length", str(len(payload)).encode())]
    if answer.data is not None:
        response_headers.append((b"content-type", b"application/json"))
    await send({"type": "http.response.start", "status": answer.status, "headers": response_headers})
    await send({"type": "http.response.body", "body": payload})
