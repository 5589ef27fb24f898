"""Monitoring pages: one workload's dashboard and the overview of running workloads (hidden is 404)."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_GET

from apps.workloads.selectors import workloads_visible_to

from . import selectors
from .metrics import OVERVIEW

MAX_OVERVIEW_WORKLOADS = 12


def _range(request: HttpRequest) -> tuple[selectors.TimeRange, str]:
    try:
        return selectors.time_range(request.GET), ""
    except selectors.RangeError as exc:
        return selectors.time_range({}), str(exc)


@login_required
@require_GET
def workload_dashboard(request: HttpRequest, workload_id: int) -> HttpResponse:
    workload = get_object_or_404(workloads_visible_to(request.user), pk=workload_id)
    span, error = _range(request)
    context = {
        "workload": workload,
        "span": span,
        "range_error": error,
        "presets": list(selectors.PRESETS),
        "charts": selectors.dashboard(workload, span),
        "query": request.GET.urlencode() if not error else "",
    }
    return render(request, "monitoring/workload.html", context, status=400 if error else 200)


@login_required
@require_GET
def running_dashboard(request: HttpRequest) -> HttpResponse:
    span, error = _range(request)
    running = list(selectors.running_workloads_visible_to(request.user)[: MAX_OVERVIEW_WORKLOADS + 1])
    sections = [
        {"workload": w, "charts": selectors.dashboard(w, span, OVERVIEW)} for w in running[:MAX_OVERVIEW_WORKLOADS]
    ]
    context = {
        "span": span,
        "range_error": error,
        "presets": list(selectors.PRESETS),
        "sections": sections,
        "more": len(running) > MAX_OVERVIEW_WORKLOADS,
        "overview": OVERVIEW,
        "query": request.GET.urlencode() if not error else "",
    }
    return render(request, "monitoring/running.html", context, status=400 if error else 200)
