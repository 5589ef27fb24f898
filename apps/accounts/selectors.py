"""Reads for accounts."""

from __future__ import annotations

from django.db.models import QuerySet

from .models import AgentToken, User


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
