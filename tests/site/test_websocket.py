"""The workload status WebSocket: the same visibility rule as pages, and live updates from heartbeats."""

from __future__ import annotations

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator
from django.test import Client

from comminsight_site.asgi import application


def cookie_for(user) -> list[tuple[bytes, bytes]]:
    headers = [(b"origin", b"http://127.0.0.1")]
    if user is not None:
        client = Client()
        client.force_login(user)
        headers.append((b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode()))
    return headers


async def connect(path: str, headers) -> tuple[WebsocketCommunicator, bool, object]:
    communicator = WebsocketCommunicator(application, path, headers=headers)
    connected, code = await communicator.connect()
    first = await communicator.receive_json_from() if connected else code
    return communicator, connected, first


@pytest.mark.parametrize(
    ("persona", "allowed"), [("alice", True), ("bob", True), ("admin", True), ("carol", False), (None, False)]
)
def test_only_people_who_see_the_workload_can_subscribe(personas, persona, allowed):
    headers = cookie_for(getattr(personas, persona) if persona else None)

    async def scenario():
        communicator, connected, first = await connect(f"/ws/workloads/{personas.workload.pk}/", headers)
        if connected:
            await communicator.disconnect()
        return connected, first

    connected, first = async_to_sync(scenario)()
    assert connected is allowed
    assert first == ({"type": "status", "status": "unknown"} if allowed else 4404)


@pytest.mark.django_db(transaction=True)
def test_a_heartbeat_reaches_an_open_socket(personas):
    from apps.accounts.services import agent_token_authenticate
    from apps.workloads.live import live_record_heartbeat

    token = agent_token_authenticate(personas.agent_secret)
    headers = cookie_for(personas.bob)

    async def scenario():
        communicator, connected, _ = await connect(f"/ws/workloads/{personas.workload.pk}/", headers)
        assert connected
        from channels.db import database_sync_to_async

        def beat():
            live_record_heartbeat(token=token, heartbeat={"workload_id": "job-1", "node": "n1", "hang": [{"r": 1}]})

        await database_sync_to_async(beat)()
        message = await communicator.receive_json_from(timeout=5)
        await communicator.disconnect()
        return message

    message = async_to_sync(scenario)()
    assert message["status"] == "hung"


def test_the_list_socket_is_for_signed_in_users_only(personas):
    async def scenario(headers):
        communicator = WebsocketCommunicator(application, "/ws/workloads/", headers=headers)
        connected, code = await communicator.connect()
        if connected:
            await communicator.disconnect()
        return connected, code

    assert async_to_sync(scenario)(cookie_for(None)) == (False, 4404)
    assert async_to_sync(scenario)(cookie_for(personas.carol))[0] is True


@pytest.mark.django_db(transaction=True)
def test_an_ingested_archive_tells_the_open_workload_page_and_the_list(personas, tmp_path, data_dir):
    # The workload page kept "0 ranks, No archives yet" and the list missed new workloads until a reload: pages
    # refresh their live regions when these sockets say something changed.
    from channels.db import database_sync_to_async

    from apps.accounts.services import agent_token_authenticate
    from apps.workloads import uploads
    from apps.workloads.models import Archive, ArchiveState, Workload
    from tests.site.archives import sha256_of, valid_archive

    token = agent_token_authenticate(personas.agent_secret)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    existing = valid_archive(tmp_path / "a", workload="job-1")
    brand_new = valid_archive(tmp_path / "b", workload="job-new")
    headers = cookie_for(personas.alice)

    def upload(path):
        with open(path, "rb") as body:
            uploads.upload_oneshot(
                token=token, sha256=sha256_of(path), filename=path.name, body=body, length=path.stat().st_size
            )

    async def scenario():
        page, connected, _ = await connect(f"/ws/workloads/{personas.workload.pk}/", headers)
        assert connected
        listing = WebsocketCommunicator(application, "/ws/workloads/", headers=headers)
        assert (await listing.connect())[0]
        await database_sync_to_async(upload)(existing)
        on_page = await page.receive_json_from(timeout=10)
        on_list = await listing.receive_json_from(timeout=10)
        await database_sync_to_async(upload)(brand_new)
        on_list_again = await listing.receive_json_from(timeout=10)
        await page.disconnect()
        await listing.disconnect()
        return on_page, on_list, on_list_again

    on_page, on_list, on_list_again = async_to_sync(scenario)()
    assert on_page == {"type": "changed"}
    assert on_list == {"type": "changed"}
    assert on_list_again == {"type": "changed"}
    assert Archive.objects.filter(state=ArchiveState.INGESTED).count() == 2
    assert Workload.objects.filter(external_id="job-new", owner=personas.alice).exists()


async def agent_heartbeat(secret: str, beat: dict) -> int:
    """A heartbeat POSTed through the site's ASGI application (answered ahead of Django), on this event loop."""
    import json

    body = json.dumps(beat).encode()
    headers = [
        (b"host", b"127.0.0.1"),
        (b"authorization", f"Bearer {secret}".encode()),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    scope = {"type": "http", "method": "POST", "path": "/api/v1/ingest/live/", "query_string": b"", "scheme": "http"}
    pending = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        return pending.pop() if pending else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await application({**scope, "headers": headers, "server": ("127.0.0.1", 8000)}, receive, send)
    return sent[0]["status"]


def progress_beat(node: str, seq: int, **extra) -> dict:
    communicators = [{"comm_hash": "c1", "last_completed_seq": seq}]
    return {"workload_id": "job-1", "node": node, "sent_ns": 1, "communicators": communicators, **extra}


@pytest.mark.django_db(transaction=True)
def test_agent_heartbeats_tell_open_pages_once_per_interval_and_a_status_change_at_once(personas, settings):
    # Every heartbeat of a 50-node job used to be told to every open page and had list pages re-read the list
    # ten times a second; within the interval only a status change is told at once.
    settings.LIVE_PUBLISH_INTERVAL_S = 3600.0
    headers = cookie_for(personas.alice)

    async def scenario():
        page, connected, _ = await connect(f"/ws/workloads/{personas.workload.pk}/", headers)
        assert connected
        listing = WebsocketCommunicator(application, "/ws/workloads/", headers=headers)
        assert (await listing.connect())[0]
        statuses = [await agent_heartbeat(personas.agent_secret, progress_beat("n1", 1))]
        first = await page.receive_json_from(timeout=10)
        first_on_list = await listing.receive_json_from(timeout=10)
        statuses.append(await agent_heartbeat(personas.agent_secret, progress_beat("n2", 2)))
        quiet_page, quiet_list = await page.receive_nothing(0.5), await listing.receive_nothing(0.5)
        statuses.append(await agent_heartbeat(personas.agent_secret, progress_beat("n1", 3, hang=[{"r": 1}])))
        hung = await page.receive_json_from(timeout=10)
        hung_on_list = await listing.receive_json_from(timeout=10)
        await page.disconnect()
        await listing.disconnect()
        return statuses, first, first_on_list, quiet_page, quiet_list, hung, hung_on_list

    statuses, first, first_on_list, quiet_page, quiet_list, hung, hung_on_list = async_to_sync(scenario)()
    assert statuses == [202, 202, 202]
    assert first["status"] == "running"
    assert first["summary"]["communicators"][0]["max_seq"] == 1
    assert first_on_list == {"type": "changed"}
    assert quiet_page
    assert quiet_list
    assert hung["status"] == "hung"
    assert hung["summary"]["hung_nodes"] == ["n1"]
    assert hung_on_list == {"type": "changed"}


@pytest.mark.django_db(transaction=True)
def test_after_a_burst_of_heartbeats_the_page_gets_the_latest_state(personas, settings):
    import time

    settings.LIVE_PUBLISH_INTERVAL_S = 1.0
    headers = cookie_for(personas.alice)

    async def scenario():
        page, connected, _ = await connect(f"/ws/workloads/{personas.workload.pk}/", headers)
        assert connected
        started = time.monotonic()
        for seq in range(1, 7):
            assert await agent_heartbeat(personas.agent_secret, progress_beat(f"n{seq % 2}", seq)) == 202
        elapsed = time.monotonic() - started
        told = [await page.receive_json_from(timeout=10)]
        while not await page.receive_nothing(2.5):
            told.append(await page.receive_json_from())
        await page.disconnect()
        return told, elapsed

    told, elapsed = async_to_sync(scenario)()
    seqs = [message["summary"]["communicators"][0]["max_seq"] for message in told]
    seen = f"told {told}, heartbeats sent in {elapsed:.2f} s"
    assert seqs == sorted(seqs), seen
    assert seqs[0] == 1, seen
    assert seqs[-1] == 6, seen  # the last state always arrives (at the end of its interval)
    # At most one message per interval after the first (however slow this machine ran the six heartbeats).
    assert len(seqs) <= 2 + int(elapsed / settings.LIVE_PUBLISH_INTERVAL_S), seen
