"""DRF authentication and permission for the machine API: ``Authorization: Bearer ci_<prefix>_<secret>``."""

from __future__ import annotations

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.permissions import BasePermission
from rest_framework.request import Request

from .models import AgentToken, AgentTokenScope
from .services import agent_token_authenticate

UNKNOWN_TOKEN = "Unknown or revoked agent token."  # noqa: S105 (a message, not a secret)


class MalformedBearer(Exception):
    """An ``Authorization: Bearer …`` header that names no usable token; the message says why (401)."""


def bearer_credential(authorization: bytes) -> str | None:
    """The agent token an ``Authorization`` header presents: None when it presents none (no header, another
    scheme), else the token text; raises ``MalformedBearer``. One reading for the API views
    (``AgentTokenAuthentication``) and the ASGI paths ahead of Django (``apps/workloads/api``)."""
    parts = authorization.split()
    if not parts or parts[0].lower() != b"bearer":
        return None
    if len(parts) != 2:
        raise MalformedBearer("Authorization header must be 'Bearer <agent token>'.")
    try:
        return parts[1].decode("ascii")
    except UnicodeDecodeError:
        raise MalformedBearer("Agent token must be ASCII.") from None


class AgentTokenAuthentication(BaseAuthentication):
    """Authenticates agents; ``request.user`` is the token's owner and ``request.auth`` the token."""

    def authenticate(self, request: Request) -> tuple[object, AgentToken] | None:
        try:
            presented = bearer_credential(get_authorization_header(request))
        except MalformedBearer as exc:
            raise exceptions.AuthenticationFailed(str(exc)) from exc
        if presented is None:
            return None
        token = agent_token_authenticate(presented)
        if token is None:
            raise exceptions.AuthenticationFailed(UNKNOWN_TOKEN)
        return token.owner, token

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="comminsight-ingest"'


class HasIngestToken(BasePermission):
    """Only requests authenticated by an active agent token with the ingest scope."""

    def has_permission(self, request: Request, view: object) -> bool:
        return isinstance(request.auth, AgentToken) and request.auth.scope == AgentTokenScope.INGEST


class AgentTokenScheme(OpenApiAuthenticationExtension):
    """Describes agent-token authentication in the OpenAPI schema (HTTP bearer)."""

    target_class = AgentTokenAuthentication
    name = "agentToken"

    def get_security_definition(self, auto_schema: object) -> dict[str, str]:
        return {"type": "http", "scheme": "bearer", "description": "Agent token: ci_<prefix>_<secret>"}
