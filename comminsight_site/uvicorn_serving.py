"""uvicorn (httptools parser, uvloop event loop) serving the site: HTTP and WebSockets, bodies streamed.

uvicorn hands a request's body to the application as it arrives and stops reading the socket while more than
64 KiB of it wait for the application (``uvicorn.protocols.http.flow_control``), so a request holds a bounded
buffer in this process whatever its length, as ``comminsight_site.daphne_streaming`` gives Daphne. What uvicorn
does not do is here, in ``BodyGuard`` around the HTTP application:

- **the body timeout**: while the application waits for body bytes and none arrives for ``body_timeout_s``, the
  client gets ``408`` with a JSON reason and the connection is closed; the application sees ``http.disconnect``;
- **closing after an early answer**: an answer started before the whole body arrived (a refusal: token, caps,
  checksum, quota, rate) carries ``Connection: close``, and the connection is closed after it without the rest of
  the body reaching the application. Closing a socket that still has unread bytes makes the kernel send a reset,
  which can reach the client before it read the answer (an agent would see a broken connection, not the 401 or
  413); so ``LingeringProtocol`` first half-closes (the answer, then end of stream) and discards what still
  arrives, for at most ``LINGER_S``, before it closes.

``serve(sockets, application, body_timeout_s)`` runs one server process on already-bound listening sockets;
``manage.py serve`` calls it (one process, or each of its ``--workers``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Application = Callable[[Scope, Receive, Send], Awaitable[None]]

# An idle keep-alive connection is closed after this long (uvicorn's default, 5 s, is what httpx's pool keeps an
# idle connection for: an agent reusing one at that moment would find it closed).
KEEP_ALIVE_S = 65.0
# How long the rest of a refused body is read and dropped before the connection closes.
LINGER_S = 2.0


def expects_body(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a request's head announces a body (a non-zero length, or chunked transfer)."""
    for name, value in headers:
        if name == b"content-length":
            return value.strip() not in (b"0", b"")
        if name == b"transfer-encoding":
            return True
    return False


class BodyGuard:
    """ASGI middleware for HTTP requests with a body: the body timeout and the close after an early answer."""

    def __init__(self, app: Application, body_timeout_s: float) -> None:
        self.app = app
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not expects_body(scope["headers"]):
            await self.app(scope, receive, send)
            return
        request = _GuardedRequest(scope, receive, send, self.body_timeout_s)
        await self.app(scope, request.receive, request.send)


class _GuardedRequest:
    __slots__ = ("_receive", "_send", "answer_started", "body_complete", "scope", "timed_out", "timeout_s")

    def __init__(self, scope: Scope, receive: Receive, send: Send, timeout_s: float) -> None:
        self.scope, self._receive, self._send, self.timeout_s = scope, receive, send, timeout_s
        self.body_complete = self.answer_started = self.timed_out = False

    async def receive(self) -> Message:
        if self.timed_out:
            return {"type": "http.disconnect"}
        if self.body_complete:  # only a disconnect can come now; no clock on it
            return await self._receive()
        try:
            # The server reads the socket while the application waits here: no message in this long means
            # no body byte arrived in this long.
            async with asyncio.timeout(self.timeout_s):
                message = await self._receive()
        except TimeoutError:
            await self._time_out()
            return {"type": "http.disconnect"}
        if message["type"] == "http.request" and not message.get("more_body", False):
            self.body_complete = True
        return message

    async def send(self, message: Message) -> None:
        if self.timed_out:  # the client got the 408 (or the connection is closing): nothing else goes out
            return
        if message["type"] == "http.response.start":
            self.answer_started = True
            if not self.body_complete:
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
        await self._send(message)

    async def _time_out(self) -> None:
        started, self.timed_out = self.answer_started, True
        logger.info("request body timeout for %s %s", self.scope.get("method"), self.scope.get("path"))
        if started:  # an answer is on its way: it ends with the connection (Connection: close was sent)
            return
        detail = f"no request body byte arrived for {self.timeout_s:g} s; the connection is closed"
        body = json.dumps({"detail": detail, "reason": "request body timeout"}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        await self._send({"type": "http.response.start", "status": 408, "headers": headers})
        await self._send({"type": "http.response.body", "body": body})


class _LingeringTransport:
    """The connection's transport as uvicorn's request cycle sees it: ``close()`` with a request body still
    arriving lingers (``LingeringProtocol.linger``) instead of closing at once."""

    def __init__(self, transport: asyncio.Transport, protocol: LingeringProtocol) -> None:
        self._transport, self._protocol = transport, protocol

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def close(self) -> None:
        if not self._protocol.linger():
            self._transport.close()

    def is_closing(self) -> bool:
        return self._protocol.lingering or self._transport.is_closing()


class LingeringProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol (httptools), closing a connection whose request body is not all read
    lingeringly: end of stream after the answer, then the client's bytes are read and dropped until it closes
    or ``LINGER_S`` passed."""

    lingering = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_LingeringTransport(transport, self))  # type: ignore[arg-type]

    def linger(self) -> bool:
        """Start lingering if the current request's body is still arriving; whether it started."""
        raw = self.transport._transport  # type: ignore[attr-defined]
        cycle = self.cycle
        if self.lingering or cycle is None or not cycle.more_body or raw.is_closing() or not raw.can_write_eof():
            return False
        self.lingering = True
        raw.write_eof()
        raw.resume_reading()
        self.loop.call_later(LINGER_S, raw.close)
        return True

    def data_received(self, data: bytes) -> None:
        if not self.lingering:
            super().data_received(data)

    def eof_received(self) -> bool | None:
        if self.lingering:  # the client is done too
            self.transport._transport.close()  # type: ignore[attr-defined]
        return None


def serve(
    sockets: list[socket.socket], application: Application, body_timeout_s: float, access_log: bool = True
) -> None:
    """Serve ``application`` (HTTP through ``BodyGuard``, WebSockets as they are) on ``sockets`` until SIGTERM or
    SIGINT; logging stays Django's (uvicorn's access lines go to the ``uvicorn.access`` logger, unless
    ``access_log`` is off: then none is formatted at all)."""
    import uvicorn

    guarded = BodyGuard(application, body_timeout_s)
    config = uvicorn.Config(
        guarded,
        loop="uvloop",
        http=LingeringProtocol,
        ws="websockets-sansio",
        lifespan="off",  # Channels' router has no lifespan protocol
        log_config=None,
        proxy_headers=False,  # as Daphne ran: the peer's address is the client's
        server_header=False,
        timeout_keep_alive=KEEP_ALIVE_S,
        access_log=access_log,
    )
    uvicorn.Server(config).run(sockets=sockets)
