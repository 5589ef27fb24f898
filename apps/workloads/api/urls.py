"""Workloads API routes (under /api/v1/)."""

from django.urls import path

from . import views

urlpatterns = [
    path("workloads/", views.WorkloadListView.as_view(), name="api-workloads"),
    path("workloads/<int:workload_id>/", views.WorkloadDetailView.as_view(), name="api-workload-detail"),
    path("workloads/<int:workload_id>/shares/", views.WorkloadShareListView.as_view(), name="api-workload-shares"),
    path(
        "workloads/<int:workload_id>/shares/<int:user_id>/",
        views.WorkloadShareDetailView.as_view(),
        name="api-workload-share-detail",
    ),
]
