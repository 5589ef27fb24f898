"""Workload pages and System Settings. Workload pages start from ``workloads_visible_to``: hidden is 404."""

from __future__ import annotations

from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_GET, require_http_methods

from apps.accounts.models import User

from .discovery import discovery_root
from .models import SystemSettings
from .selectors import (
    quarantined_archives_visible_to,
    workload_can_manage,
    workloads_visible_to,
    workloads_with_counts,
)


def _connect_hint(request: HttpRequest) -> dict[str, str]:
    """What an empty page tells a new user: the two variables an agent needs."""
    return {"server_url": settings.PUBLIC_URL or request.build_absolute_uri("/").rstrip("/")}


@login_required
@require_GET
def workload_list(request: HttpRequest) -> HttpResponse:
    context = {
        "workloads": workloads_with_counts(workloads_visible_to(request.user)),
        "quarantined": quarantined_archives_visible_to(request.user).filter(workload=None)[:20],
        **_connect_hint(request),
    }
    return render(request, "workloads/list.html", context)


@login_required
@require_GET
def workload_detail(request: HttpRequest, workload_id: int) -> HttpResponse:
    workload = get_object_or_404(workloads_visible_to(request.user), pk=workload_id)
    nodes = list(workload.nodes.prefetch_related("ranks"))
    context = {
        "workload": workload,
        "can_manage": workload_can_manage(request.user, workload),
        "shares": workload.shares.select_related("user").order_by("user__username"),
        "nodes": nodes,
        "communicators": workload.communicators.all(),
        "archives": workload.archives.order_by("-created_at")[:200],
        "rank_count": workload.ranks.count(),
        **_connect_hint(request),
    }
    return render(request, "workloads/detail.html", context)


class SystemSettingsForm(forms.ModelForm):
    class Meta:
        model = SystemSettings
        fields = ["archive_path", "discovery_owner"]
        labels = {"archive_path": "Default archive path", "discovery_owner": "Owner of discovered archives"}
        help_texts = {
            "archive_path": "The shared mount agents write to; the site scans <path>/comminsight/02_archives "
            "every 30 s. Changing it moves or deletes nothing.",
            "discovery_owner": "Empty: root.",
        }

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.fields["discovery_owner"].queryset = User.objects.filter(is_active=True).order_by("username")

    def clean_archive_path(self) -> str:
        value = self.cleaned_data["archive_path"].strip()
        if value and not value.startswith("/"):
            raise forms.ValidationError("Give an absolute path (it is read on the server).")
        if "\x00" in value:
            raise forms.ValidationError("The path contains a NUL character.")
        return value


@login_required
@require_http_methods(["GET", "POST"])
def system_settings(request: HttpRequest) -> HttpResponse:
    """Root and administrators set the default archive path; for others this page does not exist."""
    if not request.user.is_site_admin:
        raise Http404
    row = SystemSettings.load()
    form = SystemSettingsForm(request.POST or None, instance=row)
    status = 200
    if request.method == "POST":
        if form.is_valid():
            form.save()
            messages.success(request, "Settings saved.")
            return redirect("workloads:settings")
        status = 400
    root = discovery_root(row)
    context = {"form": form, "scan_dir": root, "scan_dir_exists": bool(root and root.is_dir())}
    return render(request, "workloads/settings.html", context, status=status)
