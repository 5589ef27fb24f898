"""The ingest API's rate limit: DRF's ``ScopedRateThrottle`` (scope ``ingest``, ``COMMINSIGHT_INGEST_RATE``, the
same cache key, sliding window and answers), with the window kept in one Redis round trip where the cache is
Redis.

DRF keeps an owner's window as a list of timestamps, read and written whole through the cache on every request
(pickled: 6,000 floats at the default ``6000/min``) in two round trips. On Redis the window here is a sorted
set of the same timestamps, trimmed, counted and extended by one script run on the server, which answers
whether the request is allowed and, when not, what ``wait`` needs: the same decision as DRF's (a request is
allowed while fewer than the rate's number of requests fell in the last duration; a refused one is not
counted) and the same ``Retry-After``. Any other cache (the local memory of a single worker) uses DRF's
own code. The set is kept under DRF's key with ``:window`` appended (``window_key``), never under DRF's own:
a server of an earlier version sharing the Redis (a rolling upgrade) reads that key as a list, and the two
must not trip over each other's values (while both run, each counts its own requests).
"""

from __future__ import annotations

import math
import uuid
import weakref
from typing import Any

from django.core.cache import DEFAULT_CACHE_ALIAS, caches
from django.core.cache.backends.redis import RedisCache
from rest_framework.throttling import ScopedRateThrottle

SLIDING_WINDOW = """
local key = KEYS[1]
local now, duration, limit = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', key, '-inf', now - duration)
local count = redis.call('ZCARD', key)
if count >= limit then
  local oldest = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  return {0, count, oldest[2]}
end
redis.call('ZADD', key, now, ARGV[4])
redis.call('EXPIRE', key, ARGV[5])
return {1, count + 1}
"""

# One Redis client and registered script per cache client (Django makes a cache client per thread, each with
# its own connection pool; its get_client builds a new Redis object on every call).
_SCRIPTS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _script() -> tuple[RedisCache, Any] | None:
    """The default cache (the one DRF's throttle uses) and the sliding-window script bound to its Redis, or
    None when the cache is not Redis."""
    backend = caches[DEFAULT_CACHE_ALIAS]
    if not isinstance(backend, RedisCache):
        return None
    cache_client = backend._cache
    script = _SCRIPTS.get(cache_client)
    if script is None:
        redis = cache_client.get_client(write=True)
        script = _SCRIPTS[cache_client] = redis.register_script(SLIDING_WINDOW)
    return backend, script


def window_key(drf_key: str) -> str:
    """The cache key (before the cache's prefix and version) of the window DRF keeps under ``drf_key``."""
    return drf_key + ":window"


class IngestRateThrottle(ScopedRateThrottle):
    """``ScopedRateThrottle`` with the window in one Redis round trip (see the module's docstring)."""

    def allow_request(self, request: Any, view: Any) -> bool:
        redis = _script()
        if redis is None:
            return super().allow_request(request, view)
        backend, script = redis
        self.scope = getattr(view, self.scope_attr, None)
        if not self.scope:
            return True
        self.rate = self.get_rate()
        self.num_requests, self.duration = self.parse_rate(self.rate)
        if self.rate is None:
            return True
        self.key = self.get_cache_key(request, view)
        if self.key is None:
            return True
        self.now = self.timer()
        key = backend.make_and_validate_key(window_key(self.key))
        member = f"{self.now!r}:{uuid.uuid4().hex[:12]}"
        answer = script(
            keys=[key], args=[repr(self.now), self.duration, self.num_requests, member, math.ceil(self.duration)]
        )
        self.count = int(answer[1])
        self.oldest = float(answer[2]) if len(answer) > 2 else None
        return bool(answer[0])

    def wait(self) -> float | None:
        if not hasattr(self, "count"):
            return super().wait()
        # DRF's wait() over the refused request's window: its count and its oldest timestamp.
        remaining = self.duration - (self.now - self.oldest) if self.oldest is not None else self.duration
        available = self.num_requests - self.count + 1
        if available <= 0:
            return None
        return remaining / float(available)
