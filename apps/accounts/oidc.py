"""Single sign-on through an OpenID Connect provider (mozilla-django-oidc), off unless configured.

The library runs the authorization-code flow (state, nonce, PKCE), verifies the ID token against the provider's
keys and fetches the user-info claims; this backend only maps the claims to an account
(``services.external_user_sign_in``): by the provider's subject, never by name or e-mail, as a regular user.
"""

from __future__ import annotations

from django.conf import settings
from django.http import Http404, HttpRequest, HttpResponse
from mozilla_django_oidc.auth import OIDCAuthenticationBackend
from mozilla_django_oidc.views import OIDCAuthenticationCallbackView, OIDCAuthenticationRequestView

from . import services
from .models import User


def identity_of(claims: dict) -> str:
    return f"oidc:{claims['sub']}"


class ExternalIdentityBackend(OIDCAuthenticationBackend):
    def authenticate(self, request: HttpRequest | None, **kwargs: object) -> User | None:
        if not settings.SSO_ENABLED:
            return None
        return super().authenticate(request, **kwargs)

    def verify_claims(self, claims: dict) -> bool:
        return isinstance(claims.get("sub"), str) and bool(claims["sub"])

    def filter_users_by_claims(self, claims: dict):
        return User.objects.filter(external_identity=identity_of(claims))

    def create_user(self, claims: dict) -> User:
        hint = claims.get("preferred_username") or str(claims.get("email", "")).split("@")[0] or claims["sub"]
        return services.external_user_sign_in(
            identity=identity_of(claims), username_hint=str(hint), email=str(claims.get("email") or "")
        )

    def update_user(self, user: User, claims: dict) -> User:
        return user  # name and role stay what this site made of them


def sso_start(request: HttpRequest) -> HttpResponse:
    """Redirect to the provider's sign-in page (404 while single sign-on is not configured)."""
    if not settings.SSO_ENABLED:
        raise Http404("single sign-on is not configured")
    return OIDCAuthenticationRequestView.as_view()(request)


def sso_callback(request: HttpRequest) -> HttpResponse:
    """Where the provider sends the browser back with an authorization code."""
    if not settings.SSO_ENABLED:
        raise Http404("single sign-on is not configured")
    return OIDCAuthenticationCallbackView.as_view()(request)
