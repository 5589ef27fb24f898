"""The real server (`manage.py serve --workers 2`, uvicorn and Daphne) streams upload chunks, times out silent
bodies, closes the connection after an early refusal and serves the live WebSockets."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as websocket_connect

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # starts three server processes once for each HTTP server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def manage(env: dict[str, str], *args: str) -> str:
    done = subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module", params=["uvicorn", "daphne"])
def site(request, tmp_path_factory):
    """(base URL, agent token) of a site on SQLite in a fresh data directory, body timeout 1 s, served by
    uvicorn (the default) or Daphne (COMMINSIGHT_SERVER_HTTP=daphne)."""
    data = tmp_path_factory.mktemp("site")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE")}
    env.update(
        COMMINSIGHT_SERVER_DATA_DIR=str(data),
        COMMINSIGHT_SERVER_BODY_TIMEOUT_S="1",
        COMMINSIGHT_SERVER_HTTP=request.param,
        DJANGO_SETTINGS_MODULE="comminsight_site.settings",
    )
    manage(env, "serve", "--prepare-only")
    manage(env, "shell", "-c", "from apps.accounts.models import User; User.objects.create(username='alice')")
    token = manage(env, "agent_token", "create", "--owner", "alice", "--name", "pool").split()[-1]
    with (data / "serve.log").open("w") as log:
        server = subprocess.Popen(
            [sys.executable, "manage.py", "serve", "--no-migrate", "--listen", f"127.0.0.1:{port}", "--workers", "2"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=log,
        )
        try:
            for _ in range(150):
                try:
                    httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
                    break
                except httpx.HTTPError:
                    time.sleep(0.2)
            yield f"http://127.0.0.1:{port}", token, env
        finally:
            server.terminate()
            server.wait(timeout=60)


def open_upload(client: httpx.Client, base: str, data: bytes) -> str:
    body = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "filename": "ci-x.tar.zst"}
    return client.post(f"{base}/api/v1/ingest/uploads/", json=body).json()["upload_id"]


def chunk_headers(offset: int, data: bytes) -> dict[str, str]:
    return {
        "Content-Type": "application/offset+octet-stream",
        "Upload-Offset": str(offset),
        "Upload-Checksum": f"sha256 {hashlib.sha256(data).hexdigest()}",
    }


def raw_request(base: str, head: str) -> tuple[bytes, bytes]:
    """Send only ``head`` (request line and headers, no body); (what came back, what came after it)."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(head.encode())
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            piece = conn.recv(65536)
            if not piece:
                break
            answer += piece
        return answer, conn.recv(100)


def test_chunks_sent_to_the_real_server_are_stored_and_finalized(site):
    base, token, _ = site
    data = os.urandom(3 << 20)
    with httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=60) as client:
        upload_id = open_upload(client, base, data)
        url = f"{base}/api/v1/ingest/uploads/{upload_id}/"
        for offset in range(0, len(data), 1 << 20):
            chunk = data[offset : offset + (1 << 20)]
            answer = client.patch(url, content=chunk, headers=chunk_headers(offset, chunk))
            assert answer.status_code == 204
            assert answer.headers["Upload-Offset"] == str(offset + len(chunk))
        assert client.head(url).headers["Upload-Offset"] == str(len(data))
        finalized = client.post(url + "finalize/")
    assert finalized.status_code == 201


def test_a_client_announcing_a_body_and_sending_nothing_gets_408_and_is_disconnected(site):
    base, token, _ = site
    with httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=60) as client:
        upload_id = open_upload(client, base, b"x" * 5000)
        head = (
            f"PATCH /api/v1/ingest/uploads/{upload_id}/ HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {token}\r\nUpload-Offset: 0\r\nUpload-Checksum: sha256 {'0' * 64}\r\n"
            "Content-Length: 5000\r\n\r\n"
        )
        answer, after = raw_request(base, head)
        offset = client.head(f"{base}/api/v1/ingest/uploads/{upload_id}/").headers["Upload-Offset"]
    assert answer.startswith(b"HTTP/1.1 408")
    assert b'"reason": "request body timeout"' in answer
    assert after == b""  # the server closed the connection
    assert offset == "0"


def test_a_silent_body_on_any_route_gets_408(site):
    base, _, _ = site
    head = "POST /api/v1/ingest/live/ HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n\r\n"
    answer, after = raw_request(base, head)
    assert answer.startswith(b"HTTP/1.1 408")
    assert after == b""


@pytest.mark.parametrize("sent", [0, 300_000], ids=["before its body", "after part of its body"])
def test_a_refused_chunk_is_answered_and_the_connection_closed_without_reading_the_rest(site, sent):
    base, _, _ = site
    head = (
        f"PATCH /api/v1/ingest/uploads/{'1' * 8}-1111-4111-8111-{'1' * 12}/ HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer ci_unknown_token\r\nUpload-Offset: 0\r\nUpload-Checksum: sha256 {'0' * 64}\r\n"
        "Content-Length: 8000000\r\n\r\n"
    )
    answer, after = raw_request(base, head + "x" * sent)
    assert answer.startswith(b"HTTP/1.1 401")
    assert b"connection: close" in answer.lower()
    assert after == b""


def test_agent_requests_answered_ahead_of_django_and_those_handed_to_it_both_work(site):
    base, token, _ = site
    beat = {"workload_id": "job-real", "node": "n1", "sent_ns": 1, "communicators": []}
    with httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=60) as client:
        answered = client.post(f"{base}/api/v1/ingest/live/", json=beat)
        # An Accept this path leaves to DRF's negotiation: Django gets the request with its whole body.
        handed = client.post(f"{base}/api/v1/ingest/live/", json=beat, headers={"Accept": "application/json; indent=2"})
        refused = client.post(f"{base}/api/v1/ingest/live/", json=beat, headers={"Authorization": "Bearer ci_x_y"})
    assert (answered.status_code, answered.json()) == (202, {"status": "running"})
    assert (handed.status_code, handed.json()) == (202, {"status": "running"})
    assert handed.text == '{\n  "status": "running"\n}'
    assert refused.status_code == 401
    assert refused.headers["WWW-Authenticate"] == 'Bearer realm="comminsight-ingest"'


def test_a_heartbeat_that_stops_mid_body_gets_408_and_is_disconnected(site):
    base, token, _ = site
    head = (
        f"POST /api/v1/ingest/live/ HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
        'Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{"workload_id": "job-stalled", '
    )
    answer, after = raw_request(base, head)
    assert answer.startswith(b"HTTP/1.1 408")
    assert after == b""


def test_malformed_request_heads_are_refused_with_400(site):
    base, token, _ = site
    for head in (
        f"POST /api/v1/ingest/live/ HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
        "Content-Type: application/json\r\nContent-Length: ten\r\n\r\n",
        f"POST /api/v1/ingest/uploads/ HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
        "Content-Type: application/json\r\nContent-Length: -5\r\n\r\n",
    ):
        host, port = base.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            conn.sendall(head.encode())
            answer = conn.recv(65536)
        assert answer.startswith(b"HTTP/1.1 400"), answer[:80]


def test_the_served_websocket_gives_the_owner_the_live_status_and_refuses_a_stranger(site):
    base, token, env = site
    beat = {"workload_id": "job-watched", "node": "n1", "sent_ns": 1, "communicators": []}
    httpx.post(f"{base}/api/v1/ingest/live/", json=beat, headers={"Authorization": f"Bearer {token}"}, timeout=60)
    found = manage(
        env,
        "shell",
        "-c",
        "from django.test import Client; from apps.accounts.models import User; "
        "from apps.workloads.models import Workload; client = Client(); "
        "client.force_login(User.objects.get(username='alice')); "
        "print(Workload.objects.get(external_id='job-watched').pk, client.cookies['sessionid'].value)",
    )
    workload_id, session = found.split()[-2:]
    url = base.replace("http://", "ws://") + f"/ws/workloads/{workload_id}/"
    with websocket_connect(url, origin=base, additional_headers={"Cookie": f"sessionid={session}"}) as socket_:
        first = socket_.recv(timeout=30)
    with pytest.raises(InvalidStatus) as refused:  # closed before the handshake completes: refused
        websocket_connect(url, origin=base, open_timeout=30)
    assert first == '{"type": "status", "status": "running"}'
    assert refused.value.response.status_code == 403
