"""Template context shared by every page (navigation needs the user's role)."""

from __future__ import annotations

from django.http import HttpRequest


def site(request: HttpRequest) -> dict[str, object]:
    user = getattr(request, "user", None)
    return {
        "is_site_admin": bool(user and user.is_authenticated and user.is_site_admin),
        "is_root": bool(user and user.is_authenticated and user.is_root),
    }
