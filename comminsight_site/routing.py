"""WebSocket routes (Channels). Consumers authenticate through the session and use the same selectors as pages."""

from django.urls import path

from apps.analysis.consumers import AnalysisProgressConsumer
from apps.monitoring.consumers import MonitoringConsumer
from apps.workloads.consumers import WorkloadListConsumer, WorkloadStatusConsumer

websocket_urlpatterns = [
    path("ws/workloads/", WorkloadListConsumer.as_asgi(), name="ws-workloads"),
    path("ws/workloads/<int:workload_id>/", WorkloadStatusConsumer.as_asgi(), name="ws-workload-status"),
    path(
        "ws/workloads/<int:workload_id>/analyses/",
        AnalysisProgressConsumer.as_asgi(),
        name="ws-workload-analyses",
    ),
    path("ws/monitoring/workloads/<int:workload_id>/", MonitoringConsumer.as_asgi(), name="ws-workload-monitoring"),
]
