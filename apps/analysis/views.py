"""Analysis pages: run buttons and job list, result pages, Step calibration, trace export (Perfetto).

Every view resolves the workload through ``selectors.visible_workload`` (``workloads_visible_to``): hidden or
missing is the same 404, for pages and the trace download alike.
"""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import FileResponse, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from apps.workloads.selectors import workload_can_manage
from comminsight_site.objectstore import object_store

from . import reports, selectors, services
from .models import AnalysisKind


def _list_context(request: HttpRequest, workload: object) -> dict[str, object]:
    return {
        "workload": workload,
        "jobs": selectors.workload_jobs(workload),
        "can_manage": workload_can_manage(request.user, workload),
        "forms": [
            {
                "kind": kind,
                "label": label,
                "fields": [
                    {
                        "name": f"{kind}-{name}",
                        "label": name.replace("_", " "),
                        "flag": isinstance(field, services.Flag),
                        "default": field.default,
                        "help": field.help,
                        "low": getattr(field, "low", None),
                        "high": getattr(field, "high", None),
                    }
                    for name, field in services.PARAMETERS[kind].items()
                ],
            }
            for kind, label in AnalysisKind.choices
        ],
    }


@login_required
@require_GET
def analysis_list(request: HttpRequest, workload_id: int) -> HttpResponse:
    workload = selectors.visible_workload(request.user, workload_id)
    return render(request, "analysis/list.html", _list_context(request, workload))


@login_required
@require_POST
def analysis_start(request: HttpRequest, workload_id: int) -> HttpResponse:
    workload = selectors.visible_workload(request.user, workload_id)
    kind = request.POST.get("kind", "")
    # Parameter fields are named "<kind>-<name>"; empty ones take the defaults.
    prefix = f"{kind}-"
    params = {k[len(prefix) :]: v for k, v in request.POST.items() if k.startswith(prefix) and v != ""}
    try:
        outcome = services.analysis_request(workload, kind, request.user, params, force=bool(request.POST.get("force")))
    except services.AnalysisParameterError as exc:
        context = {**_list_context(request, workload), "errors": exc.errors}
        return render(request, "analysis/list.html", context, status=400)
    if not outcome.queued:
        messages.info(request, "This analysis is already current; showing the existing result.")
    return redirect("analysis:job", workload_id=workload.pk, job_id=outcome.job.pk)


@login_required
@require_GET
def analysis_job(request: HttpRequest, workload_id: int, job_id: int) -> HttpResponse:
    job = selectors.visible_job(request.user, workload_id, job_id)
    calibration = selectors.workload_calibration(job.workload)
    comm_names = {c.comm_hash: c.comm_name for c in job.workload.communicators.all() if c.comm_name}
    report = (
        reports.report_view(job.kind, job.result, calibration, comm_names, job.parameters)
        if job.result is not None
        else None
    )
    context = {
        "workload": job.workload,
        "job": job,
        "report": report,
        "can_manage": workload_can_manage(request.user, job.workload),
    }
    return render(request, "analysis/job.html", context)


@login_required
@require_POST
def step_calibration(request: HttpRequest, workload_id: int) -> HttpResponse:
    workload = selectors.visible_workload(request.user, workload_id)
    back = request.POST.get("job")
    target = (
        reverse("analysis:job", kwargs={"workload_id": workload.pk, "job_id": int(back)})
        if back and back.isdigit() and len(back) < 12
        else reverse("analysis:list", kwargs={"workload_id": workload.pk})
    )
    try:
        if request.POST.get("action") == "clear":
            services.calibration_clear(request.user, workload)
            messages.success(request, "Step calibration cleared: steps show as recovered.")
        else:
            cal = services.calibration_apply(
                request.user, workload, request.POST.get("recovered"), request.POST.get("framework")
            )
            messages.success(request, f"Calibration applied: recovered step {cal.recovered} is step {cal.framework}.")
    except services.AnalysisPermissionDenied as exc:
        raise PermissionDenied(str(exc)) from exc
    except services.AnalysisParameterError as exc:
        context = {"message": f"Bad calibration: {exc}. Nothing was changed.", "back": target}
        return render(request, "400.html", context, status=400)
    return redirect(target)


@login_required
@require_GET
def trace_page(request: HttpRequest, workload_id: int) -> HttpResponse:
    workload = selectors.visible_workload(request.user, workload_id)
    return render(request, "analysis/trace.html", {"workload": workload})


@login_required
@require_GET
def trace_download(request: HttpRequest, workload_id: int) -> FileResponse:
    workload = selectors.visible_workload(request.user, workload_id)
    location = services.trace_export(workload)
    filename = f"comminsight-workload-{workload.pk}-trace.json"
    stream = object_store().open_stream(location)  # FileResponse streams it in blocks and closes it
    return FileResponse(stream, as_attachment=True, filename=filename, content_type="application/json")


@login_required
@require_http_methods(["GET", "POST"])
def results_delete(request: HttpRequest, workload_id: int) -> HttpResponse:
    """Confirm, then delete a workload's analysis results (manage level; read shares get 403, hidden 404)."""
    workload = selectors.visible_workload(request.user, workload_id)
    if not workload_can_manage(request.user, workload):
        raise PermissionDenied("You need the manage level on this workload to delete its results.")
    if request.method == "POST":
        outcome = services.analysis_results_delete(request.user, workload)
        text = f"Deleted {outcome.deleted} analysis result{'s' if outcome.deleted != 1 else ''}."
        if outcome.kept_busy:
            text += f" {outcome.kept_busy} still queued or running were kept."
        messages.success(request, text + " The evidence is kept: run any analysis again.")
        return redirect("analysis:list", workload_id=workload.pk)
    jobs = selectors.workload_jobs(workload)
    return render(request, "analysis/delete_results.html", {"workload": workload, "jobs": jobs})
