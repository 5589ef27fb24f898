"""WebSocket routes (Channels). Consumers authenticate through the session and use the same selectors as pages."""

from django.urls import path

from apps.analysis.consumers import AnalysisProgressConsumer
from apps.workloads.consumers import WorkloadStatusConsumer

websocket_urlpatterns = [
    path("ws/workloads/<int:workload_id>/", WorkloadStatusConsumer.as_asgi(), name="ws-workload-status"),
    path(
        "ws/workloads/<int:workload_id>/analyses/",
        AnalysisProgressConsumer.as_asgi(),
        name="ws-workload-analyses",
    ),
]
