"""DRF authentication and permission for the machine API: ``Authorization: Bearer ci_<prefix>_<secret>``."""

from __future__ import annotations

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.permissions import BasePermission
from rest_framework.request import Request

from .models import AgentToken, AgentTokenScope
from .services import agent_token_authenticate


class AgentTokenAuthentication(BaseAuthentication):
    """Authenticates agents; ``request.user`` is the token's owner and ``request.auth`` the token."""

    keyword = b"bearer"

    def authenticate(self, request: Request) -> tuple[object, AgentToken] | None:
        parts = get_authorization_header(request).split()
        if not parts or parts[0].lower() != self.keyword:
            return None
        if len(parts) != 2:
            raise exceptions.AuthenticationFailed("Authorization header must be 'Bearer <agent token>'.")
        try:
            presented = parts[1].decode("ascii")
        except UnicodeDecodeError as exc:
            raise exceptions.AuthenticationFailed("Agent token must be ASCII.") from exc
        token = agent_token_authenticate(presented)
        if token is None:
            raise exceptions.AuthenticationFailed("Unknown or revoked agent token.")
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
