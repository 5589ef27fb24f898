"""Workloads API routes (under /api/v1/), including the agents' ingest API (/api/v1/ingest/)."""

from django.urls import path

from . import ingest, views

urlpatterns = [
    path("workloads/", views.WorkloadListView.as_view(), name="api-workloads"),
    path("workloads/<int:workload_id>/", views.WorkloadDetailView.as_view(), name="api-workload-detail"),
    path("workloads/<int:workload_id>/shares/", views.WorkloadShareListView.as_view(), name="api-workload-shares"),
    path(
        "workloads/<int:workload_id>/shares/<int:user_id>/",
        views.WorkloadShareDetailView.as_view(),
        name="api-workload-share-detail",
    ),
    path(
        "workloads/<int:workload_id>/archives/", views.WorkloadArchiveListView.as_view(), name="api-workload-archives"
    ),
    path("archives/", views.ArchiveListView.as_view(), name="api-archives"),
    path("archives/<int:archive_id>/requeue/", views.ArchiveRequeueView.as_view(), name="api-archive-requeue"),
    path("ingest/uploads/", ingest.UploadCreateView.as_view(), name="api-ingest-uploads"),
    path("ingest/uploads/<uuid:upload_id>/", ingest.UploadDetailView.as_view(), name="api-ingest-upload"),
    path(
        "ingest/uploads/<uuid:upload_id>/finalize/",
        ingest.UploadFinalizeView.as_view(),
        name="api-ingest-upload-finalize",
    ),
    path("ingest/archives/", ingest.OneShotUploadView.as_view(), name="api-ingest-archives"),
    path("ingest/live/", ingest.LiveView.as_view(), name="api-ingest-live"),
]
