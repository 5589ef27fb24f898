"""Monitoring page routes."""

from django.urls import path

from . import views

app_name = "monitoring"
urlpatterns = [
    path("monitoring/", views.running_dashboard, name="running"),
    path("workloads/<int:workload_id>/monitoring/", views.workload_dashboard, name="workload"),
]
