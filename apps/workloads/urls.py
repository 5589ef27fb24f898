"""Workload page routes."""

from django.urls import path

from . import views

app_name = "workloads"
urlpatterns = [
    path("workloads/", views.workload_list, name="list"),
    path("workloads/<int:workload_id>/", views.workload_detail, name="detail"),
    path("settings/", views.system_settings, name="settings"),
]
