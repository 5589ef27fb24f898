"""The machine API on its own listener (COMMINSIGHT_SERVER_AGENT_LISTEN) and its rate limit."""

from __future__ import annotations

from django.core.cache import cache
from django.test import Client
from django.urls import reverse

from apps.workloads.api.throttling import window_key


def test_with_an_agent_listener_ingest_answers_only_there(personas, settings):
    settings.SERVER_AGENT_LISTEN = "127.0.0.1:8001"
    agent = Client(HTTP_AUTHORIZATION=f"Bearer {personas.agent_secret}")
    body = {"workload_id": "w", "node": "n1"}
    url = reverse("api-ingest-live")
    assert agent.post(url, body, content_type="application/json", SERVER_PORT="8000").status_code == 404
    assert agent.post(url, body, content_type="application/json", SERVER_PORT="8001").status_code == 202
    browser = Client()
    browser.force_login(personas.alice)
    assert browser.get(reverse("workloads:list"), SERVER_PORT="8001").status_code == 404
    assert browser.get(reverse("workloads:list"), SERVER_PORT="8000").status_code == 200


def test_without_an_agent_listener_both_share_the_main_one(personas, settings):
    settings.SERVER_AGENT_LISTEN = ""
    agent = Client(HTTP_AUTHORIZATION=f"Bearer {personas.agent_secret}")
    response = agent.post(
        reverse("api-ingest-live"), {"workload_id": "w", "node": "n1"}, content_type="application/json"
    )
    assert response.status_code == 202


def test_an_agent_over_the_rate_is_told_when_to_retry(personas, monkeypatch):
    from rest_framework.throttling import ScopedRateThrottle

    monkeypatch.setattr(ScopedRateThrottle, "THROTTLE_RATES", {"ingest": "2/min"})
    keys = [f"throttle_ingest_{personas.alice.pk}", window_key(f"throttle_ingest_{personas.alice.pk}")]
    cache.delete_many(keys)
    try:
        agent = Client(HTTP_AUTHORIZATION=f"Bearer {personas.agent_secret}")
        url = reverse("api-ingest-live")
        body = {"workload_id": "w", "node": "n1"}
        codes = [agent.post(url, body, content_type="application/json") for _ in range(3)]
        assert [r.status_code for r in codes] == [202, 202, 429]
        assert int(codes[-1]["Retry-After"]) > 0
    finally:
        cache.delete_many(keys)
