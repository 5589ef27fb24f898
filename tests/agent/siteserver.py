"""A small real HTTP server implementing the site side of upload protocol v1 (PROTOCOLS.md), for tests.

It stores finished archives in memory by sha256, keeps open uploads with their offsets, checks every
chunk's offset and checksum, and can be told to be "down" (503 + Retry-After, or refusing
connections by stopping), to throttle (429), or to lose a chunk ack so the client must resync.
"""

from __future__ import annotations

import hashlib
import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class SiteState:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.archives: dict[str, bytes] = {}
        self.uploads: dict[str, dict[str, Any]] = {}
        self.live: list[dict[str, Any]] = []
        self.down_with: int | None = None  # 503 or 429 while set
        self.retry_after = "1"
        self.max_chunk = 64 * 1024
        self.token = "test-token"
        self.requests: list[tuple[str, str]] = []
        self.drop_first_ack = False  # append the chunk but answer 503: the client must resync via 409


def make_handler(state: SiteState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _reply(self, status: int, body: Any = None, headers: dict[str, str] | None = None) -> None:
            data = b"" if body is None else json.dumps(body).encode()
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            if data:
                self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length", "0")))

        def _gate(self) -> bool:
            state.requests.append((self.command, self.path))
            if self.headers.get("Authorization") != f"Bearer {state.token}":
                self._body()
                self._reply(401, {"detail": "bad token"})
                return False
            if state.down_with:
                self._body()
                self._reply(state.down_with, {"detail": "busy"}, {"Retry-After": state.retry_after})
                return False
            return True

        def do_POST(self) -> None:
            if not self._gate():
                return
            path = self.path
            if path == "/api/v1/ingest/live/":
                with state.lock:
                    state.live.append(json.loads(self._body()))
                self._reply(202, {"status": "accepted"})
                return
            if path == "/api/v1/ingest/uploads/":
                req = json.loads(self._body())
                with state.lock:
                    if req["sha256"] in state.archives:
                        self._reply(
                            200, {"status": "complete", "sha256": req["sha256"], "archive_id": req["sha256"][:8]}
                        )
                        return
                    for uid, up in state.uploads.items():
                        if up["sha256"] == req["sha256"]:
                            self._reply(
                                200,
                                {
                                    "upload_id": uid,
                                    "offset": len(up["data"]),
                                    "status": "open",
                                    "max_chunk": state.max_chunk,
                                },
                            )
                            return
                    uid = uuid.uuid4().hex
                    state.uploads[uid] = {"sha256": req["sha256"], "size": req["size"], "data": bytearray()}
                self._reply(201, {"upload_id": uid, "offset": 0, "max_chunk": state.max_chunk, "status": "open"})
                return
            if path.startswith("/api/v1/ingest/uploads/") and path.endswith("/finalize/"):
                uid = path.split("/")[-3]
                self._body()
                with state.lock:
                    up = state.uploads.get(uid)
                    if up is None:
                        self._reply(404, {"detail": "no such upload"})
                        return
                    digest = hashlib.sha256(up["data"]).hexdigest()
                    del state.uploads[uid]
                    if digest != up["sha256"] or len(up["data"]) != up["size"]:
                        self._reply(422, {"detail": "sha256 mismatch"})
                        return
                    state.archives[digest] = bytes(up["data"])
                self._reply(201, {"status": "complete", "sha256": digest, "archive_id": digest[:8]})
                return
            self._reply(404, {"detail": "no route"})

        def do_PATCH(self) -> None:
            if not self._gate():
                return
            uid = self.path.split("/")[-2]
            data = self._body()
            with state.lock:
                up = state.uploads.get(uid)
                if up is None:
                    self._reply(404, {"detail": "no such upload"})
                    return
                offset = int(self.headers.get("Upload-Offset", "-1"))
                if offset != len(up["data"]):
                    self._reply(409, {"detail": "offset mismatch", "offset": len(up["data"])})
                    return
                algo, _, hexsum = self.headers.get("Upload-Checksum", "").partition(" ")
                if algo != "sha256" or hashlib.sha256(data).hexdigest() != hexsum:
                    self._reply(422, {"detail": "chunk checksum mismatch"})
                    return
                if len(data) > state.max_chunk or offset + len(data) > up["size"]:
                    self._reply(413, {"detail": "chunk too large"})
                    return
                up["data"] += data
                if state.drop_first_ack:
                    state.drop_first_ack = False
                    self._reply(503, {"detail": "lost ack"}, {"Retry-After": "0"})
                    return
                new = len(up["data"])
            self._reply(204, None, {"Upload-Offset": str(new)})

    return Handler


class SiteServer:
    def __init__(self) -> None:
        self.state = SiteState()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(self.state))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
