"""Workload pages and System Settings. Workload pages start from ``workloads_visible_to``: hidden is 404."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from apps.accounts.models import User
from apps.analysis.models import AnalysisJob
from apps.analysis.selectors import workloads_analysis_counts
from apps.analysis.services import analysis_cancel
from comminsight_site.charts import topology_option

from .demo import DemoError, demo_start_in_background
from .discovery import discovery_last_scan, discovery_root
from .ingest import RequeueRefused, workload_parquet_files
from .models import Archive, ShareLevel, SystemSettings, Workload
from .selectors import (
    background_tasks,
    troubled_archives_visible_to,
    workload_can_manage,
    workload_nccl_facts,
    workload_rank_coordinates,
    workloads_visible_to,
    workloads_with_counts,
)
from .services import (
    WorkloadError,
    archive_ingest_cancel,
    archive_ingest_requeue,
    workload_delete,
    workload_share,
    workload_unshare,
)


def _connect_hint(request: HttpRequest) -> dict[str, str]:
    """What an empty page tells a new user: the two variables an agent needs."""
    return {"server_url": settings.PUBLIC_URL or request.build_absolute_uri("/").rstrip("/")}


@login_required
@require_GET
def workload_list(request: HttpRequest) -> HttpResponse:
    workloads = list(workloads_with_counts(workloads_visible_to(request.user)))
    counts = workloads_analysis_counts([w.pk for w in workloads])
    for workload in workloads:
        workload.analysis_counts = counts[workload.pk]
    context = {
        "workloads": workloads,
        "quarantined": troubled_archives_visible_to(request.user).filter(workload=None)[:20],
        "can_run_demo": request.user.is_site_admin,
        **_connect_hint(request),
    }
    return render(request, "workloads/list.html", context)


@login_required
@require_POST
def demo_start(request: HttpRequest) -> HttpResponse:
    """Administrators start the demo job (a simulated 16-rank job whose agent uploads here); others: 404."""
    if not request.user.is_site_admin:
        raise Http404
    try:
        workload = demo_start_in_background(owner=request.user, page_url=request.build_absolute_uri("/"))
    except DemoError as exc:
        messages.error(request, str(exc))
        return redirect("workloads:list")
    messages.success(
        request,
        "The demo job is starting: 16 ranks come up in a few seconds, then the agent reports and uploads live. "
        "Watch the status: one rank straggles, later another hangs.",
    )
    return redirect("workloads:detail", workload_id=workload.pk)


def _lagging_ranks(workload: Workload) -> list[int]:
    return list((workload.live_summary or {}).get("lagging_ranks") or [])


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
        "archive_count": workload.archives.count(),
        "rank_count": workload.ranks.count(),
        "lagging_ranks": _lagging_ranks(workload),
        **_connect_hint(request),
    }
    return render(request, "workloads/detail.html", context)


def _topology_height(ranks: list[dict]) -> int:
    """Pixels for the topology picture. A grid (rows: pipeline stages, columns: TP ranks of each DP replica, as
    comminsight_site.charts lays it out) keeps its aspect ratio, so the box follows it at a card's usual width
    (about 840 px); other layouts are a circle."""
    if not ranks or not all(r["pp"] or r["dp"] for r in ranks):
        return 140 + 110 * max([1] + [r["pp"][1] + 1 for r in ranks if r["pp"]])
    stages = max(r["pp"][1] if r["pp"] else 0 for r in ranks)
    replicas = max(r["dp"][1] if r["dp"] else 0 for r in ranks)
    tp_size = max(r["tp"][1] if r["tp"] else 0 for r in ranks) + 1
    width = max(replicas * (tp_size + 0.8) * 70 + (tp_size - 1) * 70, 1.0)
    return int(min(900, max(220, 110 + 840 * stages * 90 / width)))


def _group_label(fact: dict) -> str:
    communicator = fact["communicator"]
    return (communicator.comm_name if communicator and communicator.comm_name else "") or str(fact["comm_id"])


def _natural_key(text: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


@login_required
@require_GET
def workload_topology(request: HttpRequest, workload_id: int) -> HttpResponse:
    """Nodes, ranks and the groups they share, as a picture; NCCL's algorithm/protocol/channels per group."""
    workload = get_object_or_404(workloads_visible_to(request.user), pk=workload_id)
    communicators = list(workload.communicators.all())
    rank_nodes = {r.rank: r.node.name for r in workload.ranks.select_related("node")}
    coordinates = workload_rank_coordinates(communicators)
    names = {c.comm_hash: c for c in communicators}
    facts = workload_nccl_facts(workload_parquet_files(workload))
    for fact in facts:
        fact["communicator"] = names.get(fact["comm_id"])
    # Groups in the order people name them (dp0, dp1 … dp10, pp0 …), the busiest choice of each group first.
    facts.sort(key=lambda fact: (_natural_key(_group_label(fact)), -fact["ops"]))
    ranks = [
        {
            "rank": rank,
            "node": node,
            "tp": coordinates.get(rank, {}).get("tp"),
            "pp": coordinates.get(rank, {}).get("pp"),
            "dp": coordinates.get(rank, {}).get("dp"),
        }
        for rank, node in sorted(rank_nodes.items())
    ]
    context = {
        "workload": workload,
        "ranks": ranks,
        "communicators": communicators,
        "facts": facts,
        "has_coordinates": any(r["tp"] or r["pp"] or r["dp"] for r in ranks),
        "chart_height": _topology_height(ranks),
        "chart": topology_option(
            rank_nodes=rank_nodes,
            communicators=[{"comm_name": c.comm_name, "ranks": c.ranks} for c in communicators],
            coordinates=coordinates,
            lagging=_lagging_ranks(workload),
        )
        if rank_nodes
        else None,
    }
    return render(request, "workloads/topology.html", context)


def _manageable_or_403(request: HttpRequest, workload_id: int) -> Workload:
    """Hidden: 404 (as everywhere). Visible without the manage level: 403, as the API answers."""
    workload = get_object_or_404(workloads_visible_to(request.user), pk=workload_id)
    if not workload_can_manage(request.user, workload):
        raise PermissionDenied("You need the manage level on this workload (or to be an administrator).")
    return workload


class ShareForm(forms.Form):
    username = forms.CharField(max_length=150, label="User name")
    level = forms.ChoiceField(choices=ShareLevel.choices, initial=ShareLevel.READ, label="Level")


@login_required
@require_http_methods(["GET", "POST"])
def workload_sharing(request: HttpRequest, workload_id: int) -> HttpResponse:
    """Share with a user at read or manage level, or unshare (owner, manage shares and administrators)."""
    workload = _manageable_or_403(request, workload_id)
    form = ShareForm(request.POST if request.POST.get("action") == "share" else None)
    status = 200
    if request.method == "POST":
        try:
            if request.POST.get("action") == "unshare":
                user = get_object_or_404(User, pk=request.POST.get("user_id", "0"))
                if workload_unshare(actor=request.user, workload=workload, user=user):
                    messages.success(request, f"{user.username} no longer sees {workload.name}.")
                return redirect("workloads:sharing", workload_id=workload.pk)
            if form.is_valid():
                user = User.objects.filter(username=form.cleaned_data["username"]).first()
                if user is None:
                    form.add_error("username", "No user has that name.")
                else:
                    share = workload_share(
                        actor=request.user, workload=workload, user=user, level=form.cleaned_data["level"]
                    )
                    messages.success(request, f"Shared with {user.username} ({share.get_level_display().lower()}).")
                    return redirect("workloads:sharing", workload_id=workload.pk)
        except WorkloadError as exc:
            form.add_error(None, str(exc))
        status = 400
    context = {
        "workload": workload,
        "form": form,
        "shares": workload.shares.select_related("user").order_by("user__username"),
    }
    return render(request, "workloads/sharing.html", context, status=status)


@login_required
@require_http_methods(["GET", "POST"])
def workload_delete_page(request: HttpRequest, workload_id: int) -> HttpResponse:
    """Delete a workload with its archives, store and results, after the user confirms by typing its name."""
    workload = _manageable_or_403(request, workload_id)
    error = ""
    if request.method == "POST":
        if request.POST.get("confirm", "").strip() == workload.name:
            name = workload.name
            workload_delete(actor=request.user, workload=workload)
            messages.success(request, f"Workload {name} and everything stored for it were deleted.")
            return redirect("workloads:list")
        error = "Type the workload's name exactly to confirm."
    context = {
        "workload": workload,
        "error": error,
        "archive_count": workload.archives.count(),
        "job_count": workload.analysis_jobs.count(),
    }
    return render(request, "workloads/delete.html", context, status=400 if error else 200)


class SystemSettingsForm(forms.ModelForm):
    class Meta:
        model = SystemSettings
        fields = ["archive_path", "discovery_owner", "max_running_analyses"]
        labels = {
            "archive_path": "Default archive path",
            "discovery_owner": "Owner of discovered archives",
            "max_running_analyses": "Analyses running at once (all workers)",
        }
        help_texts = {
            "max_running_analyses": "Shared by every Celery worker on every host; more wait in the queue. 0: no limit.",
            "archive_path": "The shared mount agents write to; the site scans <path>/comminsight/02_archives "
            "every 30 s. Changing it moves or deletes nothing. Empty: the site's default "
            "(COMMINSIGHT_SERVER_ARCHIVE_PATH), where agents on their defaults write on this machine.",
            "discovery_owner": "Empty: root.",
        }

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.fields["discovery_owner"].queryset = User.objects.filter(is_active=True).order_by("username")
        self.fields["max_running_analyses"].required = False  # left out: unchanged

    def clean_max_running_analyses(self) -> int:
        value = self.cleaned_data.get("max_running_analyses")
        return self.instance.max_running_analyses if value is None else value

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
    context = {
        "form": form,
        "scan_dir": root,
        "scan_dir_exists": bool(root and root.is_dir()),
        "tasks": background_tasks(),
        "last_scan": discovery_last_scan(),
        "discovery_interval_s": settings.DISCOVERY_INTERVAL_S,
        "now": timezone.now(),
    }
    return render(request, "workloads/settings.html", context, status=status)


def settings_action(view: Callable[..., None]) -> Callable[..., HttpResponse]:
    """An administrators' POST action of System Settings: for anyone else it does not exist (404); the view
    leaves its outcome as a message, and the answer is the settings page again."""

    @login_required
    @require_POST
    @functools.wraps(view)
    def action(request: HttpRequest, **kwargs: int) -> HttpResponse:
        if not request.user.is_site_admin:
            raise Http404
        view(request, **kwargs)
        return redirect("workloads:settings")

    return action


@settings_action
def background_job_cancel(request: HttpRequest, job_id: int) -> None:
    """Administrators cancel a queued or running analysis job."""
    job = get_object_or_404(AnalysisJob, pk=job_id)
    if analysis_cancel(request.user, job):
        messages.success(request, f"{job.get_kind_display()} of {job.workload.name} cancelled.")
    else:
        messages.info(request, "That job had already finished.")


@settings_action
def ingest_cancel(request: HttpRequest, archive_id: int) -> None:
    """Administrators cancel an archive's queued ingest (it is quarantined, bytes kept)."""
    archive = get_object_or_404(Archive, pk=archive_id)
    if archive_ingest_cancel(actor=request.user, archive=archive):
        messages.success(
            request, f"Ingest of {archive.filename} cancelled: {archive.owner.username} sees it quarantined."
        )
    else:
        messages.info(request, "That archive was not waiting for ingest (being ingested, ingested or quarantined).")


@settings_action
def ingest_requeue(request: HttpRequest, archive_id: int) -> None:
    """Administrators put a quarantined or cancelled archive back in the ingest queue."""
    archive = get_object_or_404(Archive, pk=archive_id)
    try:
        queued = archive_ingest_requeue(actor=request.user, archive=archive)
    except RequeueRefused as exc:
        messages.error(request, f"Not re-queued: {exc}.")
    else:
        if queued:
            messages.success(request, f"Ingest of {archive.filename} re-queued.")
        else:
            messages.info(request, f"{archive.filename} was already waiting for ingest.")
