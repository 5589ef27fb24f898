"""One HTTP request driven through an ASGI application in-process, for the ingest fast-path tests."""

from __future__ import annotations

from typing import Any

from asgiref.sync import async_to_sync


def asgi_request(
    application: Any, method: str, path: str, headers: dict[str, str], messages: list[dict], query: bytes = b""
) -> list[dict]:
    """Send ``messages`` (``http.request`` / ``http.disconnect``) as the request's body; the messages sent back."""
    pending = list(messages)
    sent: list[dict] = []

    async def receive() -> dict:
        return pending.pop(0)

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "query_string": query,
        "scheme": "http",
        "headers": [(k.lower().encode(), v.encode()) for k, v in {"host": "127.0.0.1", **headers}.items()],
        "server": ("127.0.0.1", 8000),
    }
    async_to_sync(application)(scope, receive, send)
    return sent


def answer(sent: list[dict]) -> tuple[int | None, list[tuple[bytes, bytes]], bytes]:
    """(status, raw headers, body) of the messages an application sent; (None, [], b"") when it sent none."""
    if not sent:
        return None, [], b""
    return sent[0]["status"], sent[0]["headers"], b"".join(m.get("body", b"") for m in sent[1:])
