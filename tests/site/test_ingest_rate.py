"""The ingest rate limit on Redis (apps.workloads.api.throttling): DRF's decisions and waits, in one round trip."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from django.conf import settings
from django.core.cache import cache
from django.core.cache.backends.locmem import LocMemCache
from rest_framework.throttling import ScopedRateThrottle

from apps.workloads.api.throttling import IngestRateThrottle, window_key

pytestmark = pytest.mark.skipif(not settings.REDIS_URL, reason="REDIS_URL is not set: the cache is not Redis")

VIEW = SimpleNamespace(throttle_scope="ingest")


def decide(throttle_class, owner, at: float, drf_cache=None) -> tuple[bool, float | None]:
    throttle = throttle_class()
    throttle.timer = lambda: at
    if drf_cache is not None:
        throttle.cache = drf_cache
    allowed = throttle.allow_request(SimpleNamespace(user=owner, META={}), VIEW)
    return allowed, None if allowed else throttle.wait()


@pytest.fixture
def three_a_minute(monkeypatch):
    monkeypatch.setattr(ScopedRateThrottle, "THROTTLE_RATES", {"ingest": "3/min"})
    cache.clear()
    yield
    cache.clear()


def test_the_redis_window_allows_and_refuses_exactly_as_drfs_list_does(personas, three_a_minute):
    # Times in seconds: a burst, refusals inside the minute, entries leaving the window one by one (one exactly at
    # its edge, which DRF counts as gone), and a quiet spell that empties it.
    times = [1000.0, 1000.5, 1001.0, 1001.2, 1030.0, 1060.0, 1060.4, 1060.6, 1061.0, 1061.5, 1200.0, 1200.1]
    drf_cache = LocMemCache("drf-reference", {})
    redis = [decide(IngestRateThrottle, personas.alice, t) for t in times]
    drf = [decide(ScopedRateThrottle, personas.alice, t, drf_cache) for t in times]
    assert [allowed for allowed, _ in redis] == [
        True,
        True,
        True,
        False,
        False,
        True,
        False,
        True,
        True,
        False,
        True,
        True,
    ]
    assert [allowed for allowed, _ in redis] == [allowed for allowed, _ in drf]
    for (_, wait), (_, drf_wait) in zip(redis, drf, strict=True):
        assert wait == pytest.approx(drf_wait)


def test_each_owner_has_a_window_of_their_own(personas, three_a_minute):
    for t in (1.0, 2.0, 3.0):
        assert decide(IngestRateThrottle, personas.alice, t)[0]
    assert not decide(IngestRateThrottle, personas.alice, 4.0)[0]
    assert decide(IngestRateThrottle, personas.bob, 4.0)[0]


def test_a_server_of_the_earlier_version_sharing_the_redis_is_not_disturbed(personas, three_a_minute):
    # During a rolling upgrade DRF's own throttle reads its key as a pickled list: the window lives elsewhere.
    assert decide(IngestRateThrottle, personas.alice, 1.0)[0]
    assert decide(ScopedRateThrottle, personas.alice, 1.0)[0]
    assert decide(IngestRateThrottle, personas.alice, 2.0)[0]


def test_deleting_the_cache_key_resets_the_window(personas, three_a_minute):
    for t in (1.0, 2.0, 3.0):
        decide(IngestRateThrottle, personas.alice, t)
    assert not decide(IngestRateThrottle, personas.alice, 4.0)[0]
    cache.delete(window_key(f"throttle_ingest_{personas.alice.pk}"))
    assert decide(IngestRateThrottle, personas.alice, 5.0)[0]
