"""Workload page routes."""

from django.urls import path

from . import views

app_name = "workloads"
urlpatterns = [
    path("workloads/", views.workload_list, name="list"),
    path("workloads/demo/", views.demo_start, name="demo"),
    path("workloads/<int:workload_id>/", views.workload_detail, name="detail"),
    path("workloads/<int:workload_id>/topology/", views.workload_topology, name="topology"),
    path("workloads/<int:workload_id>/sharing/", views.workload_sharing, name="sharing"),
    path("workloads/<int:workload_id>/delete/", views.workload_delete_page, name="delete"),
    path("settings/", views.system_settings, name="settings"),
    path("settings/jobs/<int:job_id>/cancel/", views.background_job_cancel, name="job_cancel"),
    path("settings/ingests/<int:archive_id>/cancel/", views.ingest_cancel, name="ingest_cancel"),
    path("settings/ingests/<int:archive_id>/requeue/", views.ingest_requeue, name="ingest_requeue"),
]
