"""Who gets what, for every route of the site: one table, checked against the URLconf.

Every named route must have an entry (a new route without one fails
``test_every_route_has_a_matrix_entry``). Each entry says, per method, the status each persona gets
and — for lists — how many items each persona sees. Personas: anon, agent (alice's agent token, no
session), root, admin, alice (owner), bob (alice's workload shared read), carol (not shared),
carol_agent (carol's agent token: another owner's machine credential).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver, reverse

PERSONAS = ("anon", "agent", "root", "admin", "alice", "bob", "carol", "carol_agent")


@dataclass(frozen=True)
class Case:
    method: str
    status: dict[str, int]  # persona -> expected status
    kwargs: Callable[[object], dict] = lambda p: {}
    body: Callable[[object], dict] | None = None
    content: Callable[[object], bytes] | None = None  # raw body (ingest chunks)
    headers: Callable[[object], dict] | None = None
    multipart: bool = False
    count: dict[str, int] = field(default_factory=dict)  # persona -> list length (API JSON or page context)
    count_key: str = ""  # page context variable holding the list


def statuses(
    anon: int, agent: int, root: int, admin: int, alice: int, bob: int, carol: int, carol_agent: int | None = None
) -> dict[str, int]:
    """Status per persona; carol's agent token gets what alice's does unless said otherwise."""
    codes = (anon, agent, root, admin, alice, bob, carol, agent if carol_agent is None else carol_agent)
    return dict(zip(PERSONAS, codes, strict=True))


def machine(agent: int, carol_agent: int | None = None) -> dict[str, int]:
    """Ingest API: only agent tokens; sessions and anonymous callers are 401 (Bearer challenge)."""
    return statuses(401, agent, 401, 401, 401, 401, 401, carol_agent)


def alice_upload(p) -> dict:
    """An open upload made by alice's agent token (created on first use in a test)."""
    from apps.workloads.uploads import upload_create

    if not hasattr(p, "upload"):
        p.upload = upload_create(token=p.agent_token, sha256="ab" * 32, size=10, filename="a.tar.zst").upload
    return {"upload_id": p.upload.id}


def alice_job(p) -> dict:
    """An analysis job of alice's workload (created on first use in a test)."""
    from apps.analysis.models import AnalysisJob

    if not hasattr(p, "job"):
        p.job = AnalysisJob.objects.create(
            workload=p.workload, kind="hang", parameters={"silence_s": 60.0}, parameters_key="k", created_by=p.alice
        )
    return {"workload_id": p.workload.pk, "job_id": p.job.pk}


def alice_archive(p) -> dict:
    """An archive of alice's waiting for ingest (created on first use in a test)."""
    from apps.workloads.models import Archive

    if not hasattr(p, "archive"):
        p.archive = Archive.objects.create(
            sha256="cd" * 32, size=10, filename="a.tar.zst", owner=p.alice, path="archives/missing"
        )
    return {"archive_id": p.archive.pk}


def chunk_headers(p) -> dict:
    import hashlib

    return {"HTTP_UPLOAD_OFFSET": "0", "HTTP_UPLOAD_CHECKSUM": f"sha256 {hashlib.sha256(b'01234').hexdigest()}"}


def everyone(code: int) -> dict[str, int]:
    return dict.fromkeys(PERSONAS, code)


def signed_in(anon: int, code: int) -> dict[str, int]:
    """Pages: anon and agents (no session) are sent to sign in; everyone signed in gets ``code``."""
    return statuses(anon, anon, code, code, code, code, code, anon)


ALICE_WORKLOAD = lambda p: {"workload_id": p.workload.pk}  # noqa: E731
WORKLOADS_SEEN = {"root": 2, "admin": 2, "alice": 1, "bob": 1, "carol": 1}

MATRIX: dict[str, list[Case]] = {
    "healthz": [Case("get", everyone(200))],
    "favicon": [Case("get", everyone(200))],
    "api-schema": [Case("get", everyone(200))],
    "api-docs": [Case("get", everyone(200))],
    "accounts:home": [Case("get", everyone(302))],
    "accounts:about": [Case("get", signed_in(302, 200))],
    "accounts:init": [Case("get", everyone(404)), Case("post", everyone(404), body=lambda p: {"token": "x"})],
    "accounts:login": [Case("get", statuses(200, 200, 302, 302, 302, 302, 302))],
    "accounts:logout": [Case("post", everyone(302)), Case("get", everyone(405))],
    # Single sign-on is not configured here (tests/site/test_sso.py runs a real provider): the routes are 404.
    "accounts:sso": [Case("get", everyone(404))],
    "accounts:sso_callback": [Case("get", everyone(404))],
    "accounts:password_change": [Case("get", signed_in(302, 200))],
    "accounts:users": [
        Case("get", statuses(302, 302, 200, 200, 404, 404, 404), count={"root": 5, "admin": 5}, count_key="users"),
        Case(
            "post",
            statuses(302, 302, 302, 302, 404, 404, 404),
            body=lambda p: {"username": "dave", "password": "a long password"},
        ),
    ],
    "accounts:user_role": [
        Case(
            "post",
            statuses(302, 302, 302, 404, 404, 404, 404),
            kwargs=lambda p: {"user_id": p.alice.pk},
            body=lambda p: {"admin": "1"},
        ),
        Case("get", statuses(302, 302, 405, 405, 405, 405, 405), kwargs=lambda p: {"user_id": p.alice.pk}),
    ],
    "accounts:tokens": [
        Case(
            "get",
            signed_in(302, 200),
            count={"root": 2, "admin": 2, "alice": 1, "bob": 0, "carol": 1},
            count_key="tokens",
        ),
        Case("post", signed_in(302, 201), body=lambda p: {"name": "pool-z"}),
    ],
    "accounts:token_revoke": [
        Case(
            "post",
            statuses(302, 302, 302, 302, 302, 404, 404),
            kwargs=lambda p: {"token_id": p.agent_token.pk},
        )
    ],
    "workloads:list": [Case("get", signed_in(302, 200), count=WORKLOADS_SEEN, count_key="workloads")],
    "workloads:detail": [Case("get", statuses(302, 302, 200, 200, 200, 200, 404), kwargs=ALICE_WORKLOAD)],
    # POST starts a real 16-process demo job: covered end to end in tests/browser/test_demo.py.
    "workloads:demo": [Case("get", statuses(302, 302, 405, 405, 405, 405, 405))],
    "workloads:topology": [Case("get", statuses(302, 302, 200, 200, 200, 200, 404), kwargs=ALICE_WORKLOAD)],
    "workloads:sharing": [
        Case("get", statuses(302, 302, 200, 200, 200, 403, 404), kwargs=ALICE_WORKLOAD),
        Case(
            "post",
            statuses(302, 302, 302, 302, 302, 403, 404),
            kwargs=ALICE_WORKLOAD,
            body=lambda p: {"action": "share", "username": "carol", "level": "read"},
        ),
        Case(
            "post",
            statuses(302, 302, 302, 302, 302, 403, 404),
            kwargs=ALICE_WORKLOAD,
            body=lambda p: {"action": "unshare", "user_id": p.bob.pk},
        ),
    ],
    "workloads:delete": [
        Case("get", statuses(302, 302, 200, 200, 200, 403, 404), kwargs=ALICE_WORKLOAD),
        Case(
            "post",
            statuses(302, 302, 302, 302, 302, 403, 404),
            kwargs=ALICE_WORKLOAD,
            body=lambda p: {"confirm": p.workload.name},
        ),
    ],
    "workloads:settings": [
        Case("get", statuses(302, 302, 200, 200, 404, 404, 404)),
        Case("post", statuses(302, 302, 302, 302, 404, 404, 404), body=lambda p: {"archive_path": "/srv/shared"}),
    ],
    "workloads:job_cancel": [
        Case("post", statuses(302, 302, 302, 302, 404, 404, 404), kwargs=lambda p: {"job_id": alice_job(p)["job_id"]}),
        Case("get", statuses(302, 302, 405, 405, 405, 405, 405), kwargs=lambda p: {"job_id": alice_job(p)["job_id"]}),
    ],
    "workloads:ingest_cancel": [
        Case("post", statuses(302, 302, 302, 302, 404, 404, 404), kwargs=alice_archive),
        Case("get", statuses(302, 302, 405, 405, 405, 405, 405), kwargs=alice_archive),
    ],
    "workloads:ingest_requeue": [
        Case("post", statuses(302, 302, 302, 302, 404, 404, 404), kwargs=alice_archive),
        Case("get", statuses(302, 302, 405, 405, 405, 405, 405), kwargs=alice_archive),
    ],
    "api-workload-archives": [
        Case(
            "get",
            statuses(403, 403, 200, 200, 200, 200, 404),
            kwargs=ALICE_WORKLOAD,
            count={"root": 0, "alice": 0, "bob": 0},
        )
    ],
    "api-archives": [
        Case("get", statuses(403, 403, 200, 200, 200, 200, 200), count={"root": 0, "alice": 0, "carol": 0})
    ],
    # The owner sees the archive but only administrators re-queue it (a waiting archive: nothing changes).
    "api-archive-requeue": [
        Case("post", statuses(403, 403, 200, 200, 403, 404, 404), kwargs=alice_archive),
        Case("get", everyone(405), kwargs=alice_archive),
    ],
    "api-ingest-uploads": [
        Case(
            "post",
            machine(201),
            body=lambda p: {"sha256": "cd" * 32, "size": 100, "filename": "ci-job-n1-1-2.tar.zst"},
        )
    ],
    "api-ingest-upload": [
        Case("head", machine(200, 404), kwargs=alice_upload),
        Case("patch", machine(204, 404), kwargs=alice_upload, content=lambda p: b"01234", headers=chunk_headers),
    ],
    "api-ingest-upload-finalize": [Case("post", machine(409, 404), kwargs=alice_upload)],
    "api-ingest-archives": [
        Case(
            "post",
            machine(201),
            multipart=True,
            body=lambda p: {"file": _named_bytes(b"tiny"), "sha256": __import__("hashlib").sha256(b"tiny").hexdigest()},
        )
    ],
    "api-ingest-live": [
        Case("post", machine(202), body=lambda p: {"workload_id": "job-1", "node": "10.0.0.1", "sent_ns": 1})
    ],
    "api-me": [Case("get", statuses(403, 403, 200, 200, 200, 200, 200))],
    "api-users": [
        Case("get", statuses(403, 403, 200, 200, 404, 404, 404), count={"root": 5, "admin": 5}),
        Case(
            "post",
            statuses(403, 403, 201, 201, 404, 404, 404),
            body=lambda p: {"username": "dave", "password": "a long password"},
        ),
    ],
    "api-user-role": [
        Case(
            "put",
            statuses(403, 403, 200, 404, 404, 404, 404),
            kwargs=lambda p: {"user_id": p.alice.pk},
            body=lambda p: {"admin": True},
        )
    ],
    "api-agent-tokens": [
        Case("get", statuses(403, 403, 200, 200, 200, 200, 200), count={"root": 2, "admin": 2, "alice": 1, "bob": 0}),
        Case("post", statuses(403, 403, 201, 201, 201, 201, 201), body=lambda p: {"name": "pool-z"}),
    ],
    "api-agent-token-detail": [
        Case(
            "delete",
            statuses(403, 403, 204, 204, 204, 404, 404),
            kwargs=lambda p: {"token_id": p.agent_token.pk},
        )
    ],
    "api-workloads": [Case("get", statuses(403, 403, 200, 200, 200, 200, 200), count=WORKLOADS_SEEN)],
    "api-workload-detail": [
        Case("get", statuses(403, 403, 200, 200, 200, 200, 404), kwargs=ALICE_WORKLOAD),
        Case("delete", statuses(403, 403, 204, 204, 204, 403, 404), kwargs=ALICE_WORKLOAD),
    ],
    "api-workload-shares": [
        Case(
            "get",
            statuses(403, 403, 200, 200, 200, 403, 404),
            kwargs=ALICE_WORKLOAD,
            count={"root": 1, "admin": 1, "alice": 1},
        ),
        Case(
            "post",
            statuses(403, 403, 201, 201, 201, 403, 404),
            kwargs=ALICE_WORKLOAD,
            body=lambda p: {"username": "carol", "level": "read"},
        ),
    ],
    "api-workload-share-detail": [
        Case(
            "delete",
            statuses(403, 403, 204, 204, 204, 403, 404),
            kwargs=lambda p: {"workload_id": p.workload.pk, "user_id": p.bob.pk},
        )
    ],
    "analysis:list": [Case("get", statuses(302, 302, 200, 200, 200, 200, 404), kwargs=ALICE_WORKLOAD)],
    "analysis:run": [
        Case(
            "post", statuses(302, 302, 302, 302, 302, 302, 404), kwargs=ALICE_WORKLOAD, body=lambda p: {"kind": "hang"}
        ),
        Case("get", statuses(302, 302, 405, 405, 405, 405, 405), kwargs=ALICE_WORKLOAD),
    ],
    "analysis:job": [Case("get", statuses(302, 302, 200, 200, 200, 200, 404), kwargs=alice_job)],
    "analysis:calibration": [
        Case(
            "post",
            statuses(302, 302, 302, 302, 302, 403, 404),
            kwargs=ALICE_WORKLOAD,
            body=lambda p: {"recovered": "3", "framework": "100"},
        )
    ],
    "analysis:delete_results": [
        Case("get", statuses(302, 302, 200, 200, 200, 403, 404), kwargs=ALICE_WORKLOAD),
        Case("post", statuses(302, 302, 302, 302, 302, 403, 404), kwargs=ALICE_WORKLOAD),
    ],
    "analysis:trace": [Case("get", statuses(302, 302, 200, 200, 200, 200, 404), kwargs=ALICE_WORKLOAD)],
    "analysis:trace_download": [Case("get", statuses(302, 302, 200, 200, 200, 200, 404), kwargs=ALICE_WORKLOAD)],
    "api-analyses": [
        Case("get", statuses(403, 403, 200, 200, 200, 200, 404), kwargs=ALICE_WORKLOAD, count={"alice": 0, "bob": 0}),
        Case(
            "post", statuses(403, 403, 201, 201, 201, 201, 404), kwargs=ALICE_WORKLOAD, body=lambda p: {"kind": "hang"}
        ),
    ],
    "api-analysis-detail": [Case("get", statuses(403, 403, 200, 200, 200, 200, 404), kwargs=alice_job)],
    "monitoring:running": [Case("get", signed_in(302, 200))],
    "monitoring:workload": [Case("get", statuses(302, 302, 200, 200, 200, 200, 404), kwargs=ALICE_WORKLOAD)],
    "api-workload-monitoring": [Case("get", statuses(403, 403, 200, 200, 200, 200, 404), kwargs=ALICE_WORKLOAD)],
}


def _named_bytes(data: bytes):
    from django.core.files.uploadedfile import SimpleUploadedFile

    return SimpleUploadedFile("ci-job-n1-1-2.tar.zst", data, content_type="application/octet-stream")


def route_names(patterns=None, namespace: str = "") -> set[str]:
    names: set[str] = set()
    for entry in patterns if patterns is not None else get_resolver().url_patterns:
        if isinstance(entry, URLResolver):
            inner = f"{namespace}{entry.namespace}:" if entry.namespace else namespace
            names |= route_names(entry.url_patterns, inner)
        elif isinstance(entry, URLPattern):
            assert entry.name, f"route {entry.pattern} has no name; the matrix cannot cover it"
            names.add(f"{namespace}{entry.name}")
    return names


def test_every_route_has_a_matrix_entry():
    routes = route_names()
    assert routes - MATRIX.keys() == set(), "routes missing from the permission matrix"
    assert MATRIX.keys() - routes == set(), "matrix entries for routes that no longer exist"


def client_for(persona: str, p) -> Client:
    if persona == "anon":
        return Client()
    if persona == "agent":
        return Client(HTTP_AUTHORIZATION=f"Bearer {p.agent_secret}")
    if persona == "carol_agent":
        return Client(HTTP_AUTHORIZATION=f"Bearer {p.carol_agent_secret}")
    client = Client()
    client.force_login(getattr(p, persona))
    return client


CASES = [
    pytest.param(name, index, persona, id=f"{name}-{case.method}-{persona}")
    for name, cases in MATRIX.items()
    for index, case in enumerate(cases)
    for persona in PERSONAS
]


@pytest.mark.parametrize(("route", "index", "persona"), CASES)
def test_route_answers_each_persona_as_the_matrix_says(personas, route, index, persona):
    case = MATRIX[route][index]
    url = reverse(route, kwargs=case.kwargs(personas))
    client = client_for(persona, personas)
    send = getattr(client, case.method)
    headers = case.headers(personas) if case.headers else {}
    if case.content is not None:
        response = send(url, data=case.content(personas), content_type="application/offset+octet-stream", **headers)
    elif case.body is None:
        response = send(url, **headers)
    elif case.multipart:
        response = send(url, data=case.body(personas))
    elif route.startswith("api-"):
        response = send(url, data=json.dumps(case.body(personas)), content_type="application/json")
    else:
        response = send(url, data=case.body(personas))
    assert response.status_code == case.status[persona], getattr(response, "content", b"")[:300]
    if persona in case.count:
        items = response.context[case.count_key] if case.count_key else response.json()
        assert len(items) == case.count[persona]
