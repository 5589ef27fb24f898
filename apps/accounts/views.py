"""Account pages: initialisation, sign-in/out, password change, users and roles, agent tokens."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import subprocess

import django
from axes.helpers import get_client_ip_address
from django.conf import settings
from django.contrib import messages
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse_lazy
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from comminsight_site.charts import architecture_option

from . import services
from .forms import AgentTokenCreateForm, InitialiseForm, UserCreateForm
from .models import User
from .selectors import agent_tokens_visible_to, sign_in_failures_from, users_listed_for


def client_address(request: HttpRequest) -> str:
    return str(request.META.get("REMOTE_ADDR") or "unknown")[:64]


def home(request: HttpRequest) -> HttpResponse:
    if not services.root_exists():
        return redirect("accounts:init")
    return redirect("workloads:list")


@require_http_methods(["GET", "POST"])
def initialise(request: HttpRequest) -> HttpResponse:
    """Set root's password with the bootstrap token. Once a root exists this page does not exist (404)."""
    if services.root_exists():
        raise Http404
    status = 200
    form = InitialiseForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            services.bootstrap_initialise(
                token=form.cleaned_data["token"],
                username=form.cleaned_data["username"],
                password=form.cleaned_data["password1"],
                address=client_address(request),
            )
        except services.BootstrapThrottled as exc:
            form.add_error(None, str(exc))
            status = 429
        except services.BootstrapError as exc:
            form.add_error(None, str(exc))
            status = 400
        else:
            messages.success(request, "CommInsight is initialised. Sign in as root.")
            return redirect("accounts:login")
    elif request.method == "POST":
        status = 400
    # The token's path is not shown: anonymous visitors need not learn the server's directory layout.
    return render(request, "accounts/initialise.html", {"form": form}, status=status)


class SignInView(auth_views.LoginView):
    template_name = "accounts/login.html"
    redirect_authenticated_user = True

    def dispatch(self, request: HttpRequest, *args: object, **kwargs: object) -> HttpResponse:
        if not services.root_exists():
            return redirect("accounts:init")
        if request.method == "POST" and settings.AXES_ENABLED:
            # Per name and address is axes' own lockout; this one counts every name tried from the address.
            address = get_client_ip_address(request) or "unknown"
            if sign_in_failures_from(address) >= settings.SIGN_IN_ADDRESS_FAILURE_LIMIT:
                return render(request, "accounts/locked_out.html", {"address_locked": True}, status=429)
        return super().dispatch(request, *args, **kwargs)

    def get_context_data(self, **kwargs: object) -> dict:
        return {
            **super().get_context_data(**kwargs),
            "sso_name": settings.SSO_PROVIDER_NAME if settings.SSO_ENABLED else "",
            "sso_failed": settings.SSO_ENABLED and self.request.GET.get("sso") == "failed",
        }


class SignOutView(auth_views.LogoutView):
    """POST only (Django's LogoutView refuses GET), so a link in a page cannot sign someone out."""


class PasswordChangeView(auth_views.PasswordChangeView):
    template_name = "accounts/password_change.html"
    success_url = reverse_lazy("workloads:list")

    def form_valid(self, form: object) -> HttpResponse:
        messages.success(self.request, "Your password was changed.")
        return super().form_valid(form)


def _require_site_admin(request: HttpRequest) -> None:
    # Administrators only; for everyone else the page does not exist.
    if not request.user.is_site_admin:
        raise Http404


@login_required
@require_http_methods(["GET", "POST"])
def users(request: HttpRequest) -> HttpResponse:
    """Administrators list and create users; root also grants and revokes the administrator role here."""
    _require_site_admin(request)
    form = UserCreateForm(request.POST or None)
    status = 200
    if request.method == "POST":
        if form.is_valid():
            try:
                user = services.user_create(actor=request.user, **form.cleaned_data)
            except services.AccountsError as exc:
                form.add_error(None, str(exc))
                status = 400
            else:
                messages.success(request, f"User {user.username} created.")
                return redirect("accounts:users")
        else:
            status = 400
    return render(
        request, "accounts/users.html", {"form": form, "users": users_listed_for(request.user)}, status=status
    )


@login_required
@require_POST
def user_role(request: HttpRequest, user_id: int) -> HttpResponse:
    """Root grants (admin=1) or revokes (admin=0) the administrator role."""
    if not request.user.is_root:
        raise Http404
    user = get_object_or_404(User, pk=user_id)
    try:
        services.user_set_admin(actor=request.user, user=user, admin=request.POST.get("admin") == "1")
    except services.AccountsError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"{user.username} is now {user.get_role_display().lower()}.")
    return redirect("accounts:users")


@login_required
@require_http_methods(["GET", "POST"])
def agent_tokens(request: HttpRequest) -> HttpResponse:
    """List and create agent tokens; a new token's secret is shown once, in this response only."""
    form = AgentTokenCreateForm(request.POST or None)
    issued = None
    status = 200
    if request.method == "POST":
        if form.is_valid():
            try:
                issued = services.agent_token_create(owner=request.user, name=form.cleaned_data["name"])
            except services.AccountsError as exc:
                form.add_error(None, str(exc))
                status = 400
            else:
                status = 201
                form = AgentTokenCreateForm()
        else:
            status = 400
    context = {
        "form": form,
        "issued": issued,
        "tokens": agent_tokens_visible_to(request.user),
        "server_url": request.build_absolute_uri("/").rstrip("/"),
    }
    response = render(request, "accounts/agent_tokens.html", context, status=status)
    if issued is not None:
        response["Cache-Control"] = "no-store"
    return response


@login_required
@require_POST
def agent_token_revoke(request: HttpRequest, token_id: int) -> HttpResponse:
    token = get_object_or_404(agent_tokens_visible_to(request.user), pk=token_id)
    services.agent_token_revoke(actor=request.user, token=token)
    messages.success(request, f"Token {token.name} revoked; agents using it are refused from now on.")
    return redirect("accounts:tokens")


@functools.cache
def _build() -> str:
    """The build this site runs: COMMINSIGHT_BUILD when the packager set it, else the checkout's commit."""
    if os.environ.get("COMMINSIGHT_BUILD"):
        return os.environ["COMMINSIGHT_BUILD"]
    try:
        result = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=settings.BASE_DIR,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return result.stdout.strip() or "unknown"


DOCS = [
    ("README.md", "Quick start: the CLI, a node install, running the site"),
    ("docs/site.md", "The site: pages, analyses, live updates, the demo job"),
    ("docs/operators.md", "Operating the site: settings, commands, storage, upgrades"),
    ("docs/agent.md", "The node agent"),
    ("docs/profiler.md", "The NCCL profiler plugin"),
    ("docs/analysis-hang.md", "How hangs are analysed"),
    ("docs/analysis-stragglers.md", "How stragglers are found"),
    ("docs/analysis-perf.md", "Communication performance"),
    ("docs/simulator.md", "The simulator behind the demo job"),
]


@login_required
@require_GET
def about(request: HttpRequest) -> HttpResponse:
    """Version, build, where the documentation is, and how the parts work together (a picture)."""
    context = {
        "version": importlib.metadata.version("comminsight"),
        "build": _build(),
        "django_version": django.get_version(),
        "python_version": platform.python_version(),
        "docs": DOCS,
        "chart": architecture_option(),
    }
    return render(request, "accounts/about.html", context)
