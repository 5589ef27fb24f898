"""Users with a role, the one-time bootstrap token, and agent tokens (hashed, revocable, owner-bound)."""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth.models import AbstractUser
from django.db import models
from django.db.models import Q


class Role(models.TextChoices):
    ROOT = "root", "Root"
    ADMIN = "admin", "Administrator"
    USER = "user", "User"


class User(AbstractUser):
    """A person who signs in. Root is the initialisation account; root grants and revokes administrators."""

    role = models.CharField(max_length=8, choices=Role.choices, default=Role.USER)
    # ``oidc:<subject>`` for accounts of the single sign-on provider (apps/accounts/oidc.py); such identities
    # never become administrators automatically.
    external_identity = models.CharField(max_length=255, blank=True, default="")

    class Meta:
        constraints = [
            # At most one root, ever: the initialisation race is decided by the database.
            models.UniqueConstraint(fields=["role"], condition=Q(role="root"), name="accounts_single_root"),
            # One account per single sign-on identity, even when its first two sign-ins race.
            models.UniqueConstraint(
                fields=["external_identity"], condition=~Q(external_identity=""), name="accounts_one_user_per_identity"
            ),
        ]

    @property
    def is_root(self) -> bool:
        return self.role == Role.ROOT

    @property
    def is_site_admin(self) -> bool:
        """Root and administrators see every workload and manage users."""
        return self.is_active and self.role in (Role.ROOT, Role.ADMIN)


class BootstrapToken(models.Model):
    """The hash of the one-time initialisation token; the token itself only ever lives in the 0600 file."""

    # A single row (id=1): select_for_update on it serialises concurrent initialisations.
    id = models.PositiveSmallIntegerField(primary_key=True, default=1)
    token_sha256 = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"bootstrap token issued {self.created_at:%Y-%m-%d %H:%M}"


class BootstrapFailure(models.Model):
    """One wrong bootstrap token attempt, kept to throttle guessing per client address."""

    address = models.CharField(max_length=64, db_index=True)
    at = models.DateTimeField(auto_now_add=True, db_index=True)

    def __str__(self) -> str:
        return f"wrong bootstrap token from {self.address}"


class AgentTokenScope(models.TextChoices):
    INGEST = "ingest", "Ingest (upload archives, post heartbeats)"


class AgentToken(models.Model):
    """A machine credential for agents. Shown once as ``ci_<prefix>_<secret>``; only the secret's hash is kept."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="agent_tokens")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, unique=True)
    secret_sha256 = models.CharField(max_length=64)
    scope = models.CharField(max_length=16, choices=AgentTokenScope.choices, default=AgentTokenScope.INGEST)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    # Bytes accepted through this token (uploads), checked against the per-token cap.
    uploaded_bytes = models.BigIntegerField(default=0)

    class Meta:
        ordering = ["-created_at"]
        constraints = [models.UniqueConstraint(fields=["owner", "name"], name="accounts_agent_token_name_per_owner")]

    def __str__(self) -> str:
        return f"{self.name} (ci_{self.prefix}_…)"

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None and self.owner.is_active
