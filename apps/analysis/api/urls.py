"""Analysis API routes (under /api/v1/)."""

from django.urls import path

from . import views

urlpatterns = [
    path("workloads/<int:workload_id>/analyses/", views.AnalysisListView.as_view(), name="api-analyses"),
    path(
        "workloads/<int:workload_id>/analyses/<int:job_id>/",
        views.AnalysisDetailView.as_view(),
        name="api-analysis-detail",
    ),
]
