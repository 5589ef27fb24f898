"""Workload pages. Both start from ``workloads_visible_to``: a workload the user may not see is a 404."""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_GET

from .selectors import workload_can_manage, workloads_visible_to


def _connect_hint(request: HttpRequest) -> dict[str, str]:
    """What an empty page tells a new user: the two variables an agent needs."""
    return {"server_url": settings.PUBLIC_URL or request.build_absolute_uri("/").rstrip("/")}


@login_required
@require_GET
def workload_list(request: HttpRequest) -> HttpResponse:
    workloads = workloads_visible_to(request.user)
    return render(request, "workloads/list.html", {"workloads": workloads, **_connect_hint(request)})


@login_required
@require_GET
def workload_detail(request: HttpRequest, workload_id: int) -> HttpResponse:
    workload = get_object_or_404(workloads_visible_to(request.user), pk=workload_id)
    context = {
        "workload": workload,
        "can_manage": workload_can_manage(request.user, workload),
        "shares": workload.shares.select_related("user").order_by("user__username"),
        **_connect_hint(request),
    }
    return render(request, "workloads/detail.html", context)
