"""Reads for accounts."""

from __future__ import annotations

from datetime import timedelta

from axes.models import AccessAttempt
from django.conf import settings
from django.db.models import QuerySet, Sum
from django.utils import timezone

from .models import AgentToken, User


def sign_in_failures_from(address: str) -> int:
    """Failed sign-ins from one client address within the lockout window, whatever user names were tried
    (django-axes records them per name and address; spraying one password over many names adds up here)."""
    since = timezone.now() - timedelta(hours=settings.AXES_COOLOFF_TIME)
    attempts = AccessAttempt.objects.filter(ip_address=address, attempt_time__gte=since)
    return attempts.aggregate(total=Sum("failures_since_start"))["total"] or 0


def users_listed_for(actor: User) -> QuerySet[User]:
    """Users an administrator manages (everyone); nobody for regular users."""
    if not actor.is_site_admin:
        return User.objects.none()
    return User.objects.order_by("username")


def agent_tokens_visible_to(actor: User) -> QuerySet[AgentToken]:
    """Own tokens; administrators see every token (to revoke a leaked one)."""
    tokens = AgentToken.objects.select_related("owner")
    if actor.is_site_admin:
        return tokens.all()
    return tokens.filter(owner=actor)
