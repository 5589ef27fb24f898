"""API serializers for users, roles and agent tokens."""

from __future__ import annotations

from rest_framework import serializers

from apps.accounts.models import AgentToken, User
from comminsight_site.fields import StrictBooleanField, StrictCharField


class UserSerializer(serializers.ModelSerializer):
    # Empty when unknown: a plain string in answers (``format: email`` would not admit "").
    email = serializers.CharField(read_only=True, help_text="e-mail address, or empty when unknown")

    class Meta:
        model = User
        fields = ["id", "username", "email", "role", "is_active", "date_joined"]
        read_only_fields = fields


class UserCreateSerializer(serializers.Serializer):
    username = StrictCharField(max_length=150)
    email = serializers.EmailField(required=False, default="")
    password = StrictCharField(write_only=True, trim_whitespace=False, max_length=300)


class RoleSerializer(serializers.Serializer):
    admin = StrictBooleanField(help_text="true grants the administrator role, false revokes it")


class AgentTokenSerializer(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.username", read_only=True)
    revoked = serializers.SerializerMethodField()

    class Meta:
        model = AgentToken
        fields = ["id", "name", "prefix", "owner", "scope", "created_at", "last_used_at", "revoked_at", "revoked"]
        read_only_fields = fields

    def get_revoked(self, token: AgentToken) -> bool:
        return token.revoked_at is not None


class AgentTokenCreateSerializer(serializers.Serializer):
    name = StrictCharField(max_length=100)


class AgentTokenIssuedSerializer(AgentTokenSerializer):
    token = serializers.CharField(read_only=True, help_text="The secret; shown once, in this response only")

    class Meta(AgentTokenSerializer.Meta):
        fields = [*AgentTokenSerializer.Meta.fields, "token"]
        read_only_fields = fields
