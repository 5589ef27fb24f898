"""ASGI entry point served by uvicorn (or Daphne; ``manage.py serve``): HTTP through Django, except the
agents' frequent requests, answered ahead of it (upload chunks streamed to disk: apps.workloads.api.stream;
upload create, upload HEAD and heartbeats: apps.workloads.api.agent_requests); WebSockets through Channels with
session auth."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "comminsight_site.settings")
# Django must be set up before anything imports models (the routing below does).
django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.conf import settings  # noqa: E402

from apps.workloads.api.agent_requests import AgentRequestsApp  # noqa: E402
from apps.workloads.api.stream import UploadChunkApp  # noqa: E402
from comminsight_site.routing import websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": AgentRequestsApp(UploadChunkApp(django_asgi_app)) if settings.SERVER_STREAM_BODIES else django_asgi_app,
        "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
    }
)
