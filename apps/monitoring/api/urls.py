"""Monitoring API routes (under /api/v1/)."""

from django.urls import path

from .views import WorkloadMonitoringView

urlpatterns = [
    path("workloads/<int:workload_id>/monitoring/", WorkloadMonitoringView.as_view(), name="api-workload-monitoring"),
]
