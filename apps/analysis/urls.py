"""Analysis page routes (per workload)."""

from django.urls import path

from . import views

app_name = "analysis"
urlpatterns = [
    path("workloads/<int:workload_id>/analyses/", views.analysis_list, name="list"),
    path("workloads/<int:workload_id>/analyses/run/", views.analysis_start, name="run"),
    path("workloads/<int:workload_id>/analyses/<int:job_id>/", views.analysis_job, name="job"),
    path("workloads/<int:workload_id>/analyses/calibration/", views.step_calibration, name="calibration"),
    path("workloads/<int:workload_id>/analyses/delete/", views.results_delete, name="delete_results"),
    path("workloads/<int:workload_id>/trace/", views.trace_page, name="trace"),
    path("workloads/<int:workload_id>/trace.json", views.trace_download, name="trace_download"),
]
