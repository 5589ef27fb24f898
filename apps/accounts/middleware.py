"""Keep the machine API on its own listener when ``COMMINSIGHT_SERVER_AGENT_LISTEN`` is configured.

When set, requests for ``/api/v1/ingest/`` that arrive on any other port answer 404, and the agent
listener answers 404 for everything else — browsers and agents never share a socket.
"""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse, HttpResponseNotFound

INGEST_PREFIX = "/api/v1/ingest/"


def _port(listen: str) -> str:
    return listen.rsplit(":", 1)[-1]


class AgentListenerMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        agent_listen = settings.SERVER_AGENT_LISTEN
        if agent_listen:
            on_agent_port = str(request.META.get("SERVER_PORT", "")) == _port(agent_listen)
            if request.path.startswith(INGEST_PREFIX) != on_agent_port:
                return HttpResponseNotFound()
        return self.get_response(request)
