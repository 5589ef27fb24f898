"""Daphne, streaming request bodies: the application gets the body as it arrives, not after a full copy.

Stock Daphne (through Twisted) writes a whole request body into a temporary file (memory under 100 KB)
and starts the application only once the last byte arrived. Here a request that announces its
``Content-Length`` starts the application as soon as its headers are complete, and every piece Twisted
reads is put on the application's queue as it is (no copy). The queue is bounded: past
``HIGH_WATER_BYTES`` not yet taken by the application the socket stops being read (TCP backpressure
reaches the client), and reading resumes under ``LOW_WATER_BYTES``. So a request holds at most about
``HIGH_WATER_BYTES`` plus one socket read in this process, whatever its length.

Every request with a body also has a body timeout: when no byte arrived for ``body_timeout_s`` the client
gets ``408`` with a JSON reason and the connection is closed (the application, if started, sees
``http.disconnect``), instead of a connection held open by a client that announced more than it sends.

An application that answers before the whole body arrived (a refusal) closes the connection with its
answer (``Connection: close``): the rest of the body is never read.

``install(body_timeout_s)`` points Daphne's server at these classes; ``manage.py serve`` calls it.
"""

from __future__ import annotations

import asyncio
import functools
import io
import json
import logging
import time
from typing import Any

import daphne.server
from daphne.http_protocol import HTTPFactory, WebRequest
from twisted.internet import reactor

logger = logging.getLogger(__name__)

HIGH_WATER_BYTES = 1 << 20
LOW_WATER_BYTES = 256 << 10
READ_BYTES = 256 << 10


class BodyQueue(asyncio.Queue):
    """An application's input queue that counts the body bytes it holds and pauses its request's socket."""

    def __init__(self, request: Any) -> None:
        super().__init__()
        self.request = request
        self.held = 0

    def put_nowait(self, message: dict[str, Any]) -> None:
        # Daphne's process() copies the (buffered) body into the queue at the end; a streaming request
        # has none buffered and feeds its own, so that copy is dropped.
        if message.get("type") == "http.request" and getattr(self.request, "streaming", False):
            return
        super().put_nowait(message)

    def feed(self, body: bytes, more_body: bool) -> None:
        super().put_nowait({"type": "http.request", "body": body, "more_body": more_body})
        self.held += len(body)
        if self.held > HIGH_WATER_BYTES:
            self.request.pause_reading()

    async def get(self) -> dict[str, Any]:
        message = await super().get()
        if message.get("type") == "http.request":
            self.held -= len(message.get("body", b""))
            if self.held <= LOW_WATER_BYTES:
                self.request.resume_reading()
        return message


class StreamingRequest(WebRequest):
    """Daphne's request, with the body streamed to the application and a timeout between body bytes."""

    body_timeout_s: float = 30.0
    streaming = False
    body_complete = False
    body_timed_out = False
    _paused = False
    _body_deadline = 0.0
    _body_timer: Any = None

    # --- Twisted's callbacks (headers done, body pieces, body done) ---

    def gotLength(self, length: int | None) -> None:
        if length != 0:  # a body is coming (a length, or chunked): it must keep arriving
            self._arm_body_timer()
        upgrade = self.requestHeaders.hasHeader(b"upgrade")
        if not length or upgrade:
            super().gotLength(length)
            return
        self.streaming = True
        # Larger socket reads for a streamed body: a quarter of the Python work per byte of Twisted's 64 KiB.
        transport = getattr(self.channel, "transport", None)
        if transport is not None and getattr(transport, "bufferSize", READ_BYTES) < READ_BYTES:
            transport.bufferSize = READ_BYTES
        self.content = io.BytesIO()  # stays empty: the body goes straight to the application
        channel = self.channel
        # What Twisted's requestReceived would set once the body is in; Daphne's process() reads them.
        self.method, self.uri, self.clientproto = channel._command, channel._path, channel._version
        self.path = self.uri.split(b"?", 1)[0]
        self.args = {}
        self.process()

    def handleContentChunk(self, data: bytes) -> None:
        self._body_deadline = time.monotonic() + self.body_timeout_s
        if not self.streaming:
            super().handleContentChunk(data)
            return
        if self.application_queue is not None and not self.finished:
            self.application_queue.feed(data, True)

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
        self.body_complete = True
        self._cancel_body_timer()
        if not self.streaming:
            super().requestReceived(command, path, version)
            return
        if self.application_queue is not None and not self.finished:
            self.application_queue.feed(b"", False)

    # --- replies ---

    def handle_reply(self, message: dict[str, Any]) -> None:
        if (
            message.get("type") == "http.response.start"
            and self.streaming
            and not self.body_complete
            and not self.finished
        ):
            self._close_after_reply()
            message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
        super().handle_reply(message)

    def finish(self) -> None:
        self._cancel_body_timer()
        if not self.body_complete:
            self._close_after_reply()
        super().finish()

    def connectionLost(self, reason: Any) -> None:
        self._cancel_body_timer()
        super().connectionLost(reason)

    def _close_after_reply(self) -> None:
        """The body is not all read: answer, then close, and ignore whatever else the client sends."""
        channel = self.channel
        if channel is not None:
            channel.persistent = False
            channel.dataReceived = lambda data: None
            self.resume_reading()

    # --- flow control (called by BodyQueue) ---

    def pause_reading(self) -> None:
        if not self._paused and self.channel is not None:
            self._paused = True
            self.channel._networkProducer.pauseProducing()

    def resume_reading(self) -> None:
        if self._paused and self.channel is not None:
            self._paused = False
            self.channel._networkProducer.resumeProducing()

    # --- body timeout ---

    def _arm_body_timer(self) -> None:
        self._body_deadline = time.monotonic() + self.body_timeout_s
        self._body_timer = reactor.callLater(self.body_timeout_s, self._check_body_timer)

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None and self._body_timer.active():
            self._body_timer.cancel()
        self._body_timer = None

    def _check_body_timer(self) -> None:
        self._body_timer = None
        if self.body_complete or self.finished or self.channel is None:
            return
        left = self._body_deadline - time.monotonic()
        if self._paused or left > 0:  # bytes arrived meanwhile, or we are the ones not reading
            self._body_timer = reactor.callLater(max(left, 0.05) if not self._paused else 1.0, self._check_body_timer)
            return
        self.body_timed_out = True
        if self._response_started:
            self.channel.transport.abortConnection()
            return
        detail = f"no request body byte arrived for {self.body_timeout_s:g} s; the connection is closed"
        body = json.dumps({"detail": detail, "reason": "request body timeout"}).encode()
        logger.info("request body timeout for %s %s", self.method, self.uri)
        self._response_started = True
        self._close_after_reply()
        self.setResponseCode(408)
        self.setHeader(b"content-type", b"application/json")
        self.setHeader(b"content-length", str(len(body)).encode())
        self.setHeader(b"connection", b"close")
        self.write(body)
        self.finish()


class StreamingHTTPFactory(HTTPFactory):
    def buildProtocol(self, addr: Any) -> Any:
        protocol = super().buildProtocol(addr)
        protocol.requestFactory = StreamingRequest
        return protocol

    def log(self, request: Any) -> None:
        """Twisted's own line per request (combined log format, for Twisted's log), which Daphne sends nowhere
        at verbosity 1 and below: not formatted then (py-spy under the 50-agent crowd: about 2% of the workers'
        time). Daphne's access log (stdout) is written as before."""
        if self.server.verbosity > 1:
            super().log(request)


class StreamingServer(daphne.server.Server):
    """Daphne's server, giving each application a ``BodyQueue`` tied to its request."""

    def create_application(self, protocol: Any, scope: dict[str, Any]) -> BodyQueue | None:
        assert "application_instance" not in self.connections[protocol]
        input_queue = BodyQueue(protocol)
        scope.setdefault("asgi", {"version": "3.0"})
        instance = self.application(
            scope=scope, receive=input_queue.get, send=functools.partial(self.handle_reply, protocol)
        )
        if protocol not in self.connections:
            return None
        self.connections[protocol]["application_instance"] = asyncio.ensure_future(
            instance, loop=asyncio.get_event_loop()
        )
        return input_queue


def install(body_timeout_s: float) -> type[StreamingServer]:
    """Make Daphne build streaming requests; returns the server class to run."""
    StreamingRequest.body_timeout_s = body_timeout_s
    daphne.server.HTTPFactory = StreamingHTTPFactory  # Server.run builds its factory by this name
    return StreamingServer
