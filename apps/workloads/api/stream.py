"""The upload chunk route (``PATCH /api/v1/ingest/uploads/<id>/``) as an ASGI application ahead of Django.

Under Django a chunk is copied whole into Django's request body before the view reads it. Here the body
messages the server delivers (``comminsight_site.uvicorn_serving`` or ``daphne_streaming``: as they arrive,
with backpressure)
are hashed and written to the upload's part file by a pool thread in batches of about 1 MiB, one batch at
a time, while the event loop receives the next: a request holds at most two batches.

The checks are the API view's, in the same order and with the same answers, all before a byte is
written: allowed host, agent listener, agent token (401), ingest scope (403), rate (429), then
``uploads.chunk_begin`` (offset, checksum header, chunk and size caps, the part file's lock). The
writing and committing are ``uploads.ChunkWriter``'s, shared with the view. Every other request goes
to Django unchanged.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, Literal

from django.conf import settings
from django.db import close_old_connections
from django.http.request import split_domain_port, validate_host
from rest_framework import exceptions

from apps.accounts.authentication import UNKNOWN_TOKEN, MalformedBearer, bearer_credential
from apps.accounts.middleware import INGEST_PREFIX, _port
from apps.accounts.models import AgentTokenScope
from apps.accounts.services import agent_token_authenticate
from apps.workloads import uploads

from .throttling import IngestRateThrottle

WRITE_BATCH_BYTES = 1 << 20
# Hashing and writing large chunk bodies; one batch of one request at a time each.
WRITERS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="upload-writer")
# The checks and statements of the requests answered ahead of Django; as many threads as the event loop's
# default pool (which asgiref's sync_to_async used before).
DATABASE_THREADS = ThreadPoolExecutor(max_workers=min(32, (os.cpu_count() or 1) + 4), thread_name_prefix="agent-db")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

CHUNK_ROUTE = re.compile(
    "^" + re.escape(INGEST_PREFIX) + r"uploads/([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})/$"
)


class Refused(Exception):
    """An answer given before any byte is written."""

    def __init__(self, status: int, detail: str, headers: list[tuple[bytes, bytes]] | None = None, **extra: Any):
        super().__init__(detail)
        self.status, self.body, self.headers = status, {"detail": detail, **extra}, headers or []


def _in_pool(function: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
    """Run ``function`` in a database thread (not Django's one request thread), with its database connection
    handled as Django does around a request. A plain ``run_in_executor``: asgiref's ``sync_to_async`` also
    copies the request's context into the thread, which these functions do not use, at a cost per call."""

    def run(*args: Any) -> Any:
        close_old_connections()
        try:
            return function(*args)
        finally:
            close_old_connections()

    async def call(*args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(DATABASE_THREADS, run, *args)

    return call


class UploadChunkApp:
    """ASGI: streams upload chunks to disk; passes every other request to ``app`` (Django)."""

    def __init__(self, app: Any, run_sync: Callable[[Callable[..., Any]], Callable[..., Awaitable[Any]]] = _in_pool):
        self.app = app
        self.run_sync = run_sync

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = CHUNK_ROUTE.match(scope.get("path", "")) if scope["type"] == "http" else None
        if match is None or scope["method"] != "PATCH" or not self._on_agent_listener(scope):
            await self.app(scope, receive, send)
            return
        await self.append(scope, receive, send, uuid.UUID(match.group(1)))

    @staticmethod
    def _on_agent_listener(scope: Scope) -> bool:
        """With a separate agent listener, only requests on its port are ours (Django answers the rest 404)."""
        if not settings.SERVER_AGENT_LISTEN:
            return True
        server = scope.get("server") or (None, None)
        return str(server[1]) == _port(settings.SERVER_AGENT_LISTEN)

    async def append(self, scope: Scope, receive: Receive, send: Send, upload_id: uuid.UUID) -> None:
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        try:
            writer = await self.run_sync(_chunk_begin)(headers, upload_id)
        except Refused as refused:
            await _respond(send, refused.status, refused.body, refused.headers)
            return
        try:
            if not await _write_body(writer, receive):
                writer.abort()  # the client went away (or its body timed out): nothing appended
                return
            upload = await self.run_sync(writer.commit)()
        except uploads.UploadError as exc:
            writer.abort()
            await _respond(send, exc.status, {"detail": exc.detail, **exc.extra})
            return
        except BaseException:
            writer.abort()
            raise
        await _respond(send, 204, None, [(b"upload-offset", str(upload.offset).encode())])


async def _write_body(writer: uploads.ChunkWriter, receive: Receive) -> bool:
    """Hash and write the body through ``writer``; False if the client went away first.

    Pieces are handed to a writer thread in batches of about ``WRITE_BATCH_BYTES`` (hashlib and pwrite release
    the GIL), one batch at a time, while the event loop goes on receiving the next one and serving other
    requests. So a request holds at most two batches here, plus what the server queued for it. The writers
    are threads of their own, not the pool the database work waits in, and a body smaller than one batch is
    written on the loop once it is all in (hashing 256 KiB takes about as long as a hop to a thread)."""
    loop = asyncio.get_running_loop()
    in_flight: asyncio.Future[None] | None = None
    batch: list[bytes] = []
    size = 0
    try:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return False
            body = message.get("body", b"")
            if body:
                batch.append(body)
                size += len(body)
            last = not message.get("more_body", False)
            if last and in_flight is None and size < WRITE_BATCH_BYTES:
                writer.write_all(batch)  # a small body whole: less work on the loop than a trip to a thread
                batch, size = [], 0
            elif size >= WRITE_BATCH_BYTES or (last and batch):
                if in_flight is not None:
                    await in_flight
                in_flight = loop.run_in_executor(WRITERS, writer.write_all, batch)
                batch, size = [], 0
            if last:
                break
        if in_flight is not None:
            await in_flight
        return True
    finally:
        # Never leave a write running on the part file once the caller aborts or commits.
        if in_flight is not None:
            if not in_flight.done():
                await asyncio.wait([in_flight])
            if not in_flight.cancelled():
                in_flight.exception()  # retrieved: a failed write was answered (or the client left)


def _chunk_begin(headers: dict[str, str], upload_id: uuid.UUID) -> uploads.ChunkWriter:
    """Authenticate, check scope and rate, then open the chunk; raises Refused."""
    if not host_allowed(headers):
        raise Refused(400, "Bad Request: the Host header is not allowed")
    token = _authenticate(headers.get("authorization", ""))
    if token.scope != AgentTokenScope.INGEST:
        raise Refused(403, str(exceptions.PermissionDenied.default_detail))
    wait = throttle_wait(token.owner)
    if wait is not False:
        retry = [(b"retry-after", str(int(wait)).encode())] if wait is not None else []
        raise Refused(429, str(exceptions.Throttled(wait).detail), retry)
    try:
        offset = int(headers.get("upload-offset", ""))
    except ValueError:
        raise Refused(400, "Upload-Offset header must be an integer") from None
    try:
        length = int(headers.get("content-length") or 0)
    except ValueError:
        raise Refused(400, "bad Content-Length") from None
    if length < 0:
        raise Refused(400, "bad Content-Length")
    try:
        return uploads.chunk_begin(
            owner=token.owner,
            upload_id=upload_id,
            offset=offset,
            checksum=headers.get("upload-checksum"),
            length=length,
        )
    except uploads.UploadError as exc:
        raise Refused(exc.status, exc.detail, **exc.extra) from None


def throttle_wait(owner: Any) -> float | None | Literal[False]:
    """The ingest views' rate limit (``IngestRateThrottle``, scope ``ingest``) for a request of ``owner``:
    False when allowed (and counted), else the seconds to wait (None: unknown)."""
    throttle = IngestRateThrottle()
    if throttle.allow_request(SimpleNamespace(user=owner, META={}), SimpleNamespace(throttle_scope="ingest")):
        return False
    return throttle.wait()


def host_allowed(headers: dict[str, str]) -> bool:
    """Whether Django would take the request's host (``HttpRequest.get_host``: ``X-Forwarded-Host`` when
    ``USE_X_FORWARDED_HOST``, checked against ``ALLOWED_HOSTS``, or the local names under ``DEBUG``)."""
    if settings.USE_X_FORWARDED_HOST and "x-forwarded-host" in headers:
        raw = headers["x-forwarded-host"]
    else:
        raw = headers.get("host", "")
    domain, _ = split_domain_port(raw)
    allowed = settings.ALLOWED_HOSTS or ([".localhost", "127.0.0.1", "[::1]"] if settings.DEBUG else [])
    return bool(domain) and validate_host(domain, allowed)


def _authenticate(authorization: str) -> Any:
    """The agent token presented, as ``AgentTokenAuthentication`` decides it; raises Refused (401)."""
    challenge = [(b"www-authenticate", b'Bearer realm="comminsight-ingest"')]
    try:
        presented = bearer_credential(authorization.encode("latin-1"))
    except MalformedBearer as exc:
        raise Refused(401, str(exc), challenge) from None
    if presented is None:
        raise Refused(401, str(exceptions.NotAuthenticated.default_detail), challenge)
    token = agent_token_authenticate(presented)
    if token is None:
        raise Refused(401, UNKNOWN_TOKEN, challenge)
    return token


async def _respond(send: Send, status: int, body: dict[str, Any] | None, headers: list | None = None) -> None:
    payload = b"" if body is None else json.dumps(body).encode()
    response_headers = [(b"cache-control", b"no-store"), *(headers or [])]
    if body is not None:
        response_headers += [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": response_headers})
    await send({"type": "http.response.body", "body": payload})
