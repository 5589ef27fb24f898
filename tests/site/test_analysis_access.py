"""Who sees analyses, the Perfetto trace export, the opener policy that lets "Open in Perfetto" work, and the
live progress socket. Hidden is 404 everywhere (pages, downloads, API, websocket close 4404)."""

from __future__ import annotations

import json

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator
from django.test import Client
from django.urls import reverse

from comminsight_site.asgi import application
from tests.site.analysis_tables import hung_table, write_store


def client_of(user) -> Client:
    client = Client()
    if user is not None:
        client.force_login(user)
    return client


@pytest.fixture
def alice_job(personas, data_dir, django_capture_on_commit_callbacks):
    """A finished hang analysis of alice's workload (whose store holds a hung job)."""
    from apps.analysis.services import analysis_request

    write_store(data_dir, personas.workload.pk, hung_table())
    with django_capture_on_commit_callbacks(execute=True):
        job = analysis_request(personas.workload, "hang", personas.alice).job
    job.refresh_from_db()
    assert job.state == "done"
    return job


def routes(workload_id: int, job_id: int) -> list[tuple[str, str, dict]]:
    both = {"workload_id": workload_id, "job_id": job_id}
    only = {"workload_id": workload_id}
    return [
        ("get", reverse("analysis:list", kwargs=only), {}),
        ("get", reverse("analysis:job", kwargs=both), {}),
        ("get", reverse("analysis:trace", kwargs=only), {}),
        ("get", reverse("analysis:trace_download", kwargs=only), {}),
        ("post", reverse("analysis:run", kwargs=only), {"kind": "hang"}),
        ("post", reverse("analysis:calibration", kwargs=only), {"recovered": "1", "framework": "2"}),
        ("get", reverse("api-analyses", kwargs=only), {}),
        ("get", reverse("api-analysis-detail", kwargs=both), {}),
    ]


def test_carol_gets_404_for_every_analysis_route_of_a_workload_not_shared_with_her(personas, alice_job):
    from apps.analysis.models import AnalysisJob, StepCalibration

    carol = client_of(personas.carol)
    for method, url, body in routes(personas.workload.pk, alice_job.pk):
        assert getattr(carol, method)(url, body).status_code == 404, url
    # Nor can she reach alice's job through her own workload's URL.
    for method, url, body in (
        routes(personas.other_workload.pk, alice_job.pk)[1:2] + routes(personas.other_workload.pk, alice_job.pk)[7:]
    ):
        assert getattr(carol, method)(url, body).status_code == 404, url
    assert AnalysisJob.objects.count() == 1
    assert not StepCalibration.objects.exists()


def test_anonymous_callers_learn_nothing_about_which_workloads_exist(personas, alice_job):
    anonymous = client_of(None)
    real = routes(personas.workload.pk, alice_job.pk)
    missing = routes(987654, 987654)
    for (method, url, body), (_, url_missing, _) in zip(real, missing, strict=True):
        seen = getattr(anonymous, method)(url, body)
        unseen = getattr(anonymous, method)(url_missing, body)
        assert seen.status_code == unseen.status_code
        assert seen.status_code in (302, 403)
        if seen.status_code == 302:
            assert seen["Location"].startswith(reverse("accounts:login"))
        assert b"llama" not in seen.content
        assert b"verdict" not in seen.content


def test_the_perfetto_download_is_a_json_trace_of_the_workloads_operations(personas, data_dir):
    table = hung_table(ranks=4, ops=10, stuck_rank=2)
    write_store(data_dir, personas.workload.pk, table)
    response = client_of(personas.bob).get(
        reverse("analysis:trace_download", kwargs={"workload_id": personas.workload.pk})
    )
    assert response.status_code == 200
    assert response["Content-Type"] == "application/json"
    assert "attachment" in response["Content-Disposition"]
    trace = json.loads(b"".join(response.streaming_content))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    slices = [e for e in events if e.get("ph") == "X"]
    instants = [e for e in events if e.get("ph") == "i"]
    # 40 completed all-reduces as slices; the 3 never-finished ones of the hang as instants.
    assert len(slices) == 40
    assert len(instants) == 3
    assert {e["pid"] for e in slices} == {0, 1, 2, 3}
    assert {e["name"] for e in slices} == {"all_reduce · world"}  # the operation and its communicator's name


def test_a_workload_with_nothing_ingested_still_downloads_a_valid_empty_trace(personas):
    response = client_of(personas.alice).get(
        reverse("analysis:trace_download", kwargs={"workload_id": personas.workload.pk})
    )
    assert response.status_code == 200
    trace = json.loads(b"".join(response.streaming_content))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert [e for e in events if e.get("ph") in ("X", "i")] == []


def test_the_trace_page_offers_open_in_perfetto_without_a_same_origin_opener_policy(personas, alice_job):
    alice = client_of(personas.alice)
    page = alice.get(reverse("analysis:trace", kwargs={"workload_id": personas.workload.pk}))
    assert page.status_code == 200
    assert "data-perfetto-open" in page.content.decode()
    # same-origin would sever the window.open() link the postMessage handshake needs.
    assert page.headers.get("Cross-Origin-Opener-Policy") != "same-origin"
    assert page.headers.get("Cross-Origin-Opener-Policy") == "same-origin-allow-popups"
    for url in (
        reverse("analysis:job", kwargs={"workload_id": personas.workload.pk, "job_id": alice_job.pk}),
        reverse("workloads:detail", kwargs={"workload_id": personas.workload.pk}),
    ):
        assert alice.get(url).headers.get("Cross-Origin-Opener-Policy") != "same-origin"


def cookie_for(user) -> list[tuple[bytes, bytes]]:
    headers = [(b"origin", b"http://127.0.0.1")]
    if user is not None:
        client = client_of(user)
        headers.append((b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode()))
    return headers


@pytest.mark.parametrize(("persona", "allowed"), [("bob", True), ("admin", True), ("carol", False), (None, False)])
def test_only_people_who_see_the_workload_can_follow_its_analyses(personas, alice_job, persona, allowed):
    headers = cookie_for(getattr(personas, persona) if persona else None)

    async def scenario():
        socket = WebsocketCommunicator(application, f"/ws/workloads/{personas.workload.pk}/analyses/", headers=headers)
        connected, code = await socket.connect()
        first = await socket.receive_json_from() if connected else code
        if connected:
            await socket.disconnect()
        return connected, first

    connected, first = async_to_sync(scenario)()
    assert connected is allowed
    if allowed:
        assert (first["id"], first["state"], first["progress"]) == (alice_job.pk, "done", 100)
    else:
        assert first == 4404


@pytest.mark.django_db(transaction=True)
def test_progress_of_a_running_job_reaches_an_open_socket(personas, data_dir):
    from channels.db import database_sync_to_async

    from apps.analysis.services import analysis_request

    write_store(data_dir, personas.workload.pk, hung_table())
    headers = cookie_for(personas.bob)

    async def scenario():
        socket = WebsocketCommunicator(application, f"/ws/workloads/{personas.workload.pk}/analyses/", headers=headers)
        connected, _ = await socket.connect()
        assert connected
        # Outside a transaction the task (eager) runs at once, publishing as it goes.
        await database_sync_to_async(lambda: analysis_request(personas.workload, "hang", personas.bob))()
        seen = []
        while not seen or seen[-1]["state"] not in ("done", "failed"):
            seen.append(await socket.receive_json_from(timeout=5))
        assert await socket.receive_nothing(timeout=0.2)  # nothing stale arrives after the end
        await socket.disconnect()
        return seen

    seen = async_to_sync(scenario)()
    assert seen[0]["state"] == "queued"
    assert seen[-1]["state"] == "done"
    progress = [m["progress"] for m in seen]
    assert progress == sorted(progress)
    assert progress[-1] == 100


def test_deleting_a_workload_removes_its_cached_trace(personas, data_dir, django_capture_on_commit_callbacks):
    write_store(data_dir, personas.workload.pk, hung_table())
    alice = client_of(personas.alice)
    download = alice.get(reverse("analysis:trace_download", kwargs={"workload_id": personas.workload.pk}))
    assert json.loads(b"".join(download.streaming_content))
    exports = data_dir / "exports" / f"workload-{personas.workload.pk}"
    assert len(list(exports.glob("trace-*.json"))) == 1
    with django_capture_on_commit_callbacks(execute=True):
        response = alice.delete(reverse("api-workload-detail", kwargs={"workload_id": personas.workload.pk}))
    assert response.status_code == 204
    assert not exports.exists()
