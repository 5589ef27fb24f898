"""API serializers for workloads, shares and archives."""

from __future__ import annotations

from rest_framework import serializers

from apps.workloads.models import Archive, ShareLevel, Workload, WorkloadShare
from comminsight_site.fields import StrictCharField


class WorkloadSerializer(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.username", read_only=True)
    nodes = serializers.IntegerField(source="node_count", read_only=True, default=None)
    ranks = serializers.IntegerField(source="rank_count", read_only=True, default=None)
    archives = serializers.IntegerField(source="archive_count", read_only=True, default=None)

    class Meta:
        model = Workload
        fields = [
            "id",
            "name",
            "external_id",
            "owner",
            "status",
            "created_at",
            "updated_at",
            "first_seen_at",
            "last_seen_at",
            "nodes",
            "ranks",
            "archives",
            "live_summary",
        ]
        read_only_fields = fields


class ArchiveSerializer(serializers.ModelSerializer):
    class Meta:
        model = Archive
        fields = [
            "id",
            "sha256",
            "size",
            "filename",
            "source",
            "state",
            "reason",
            "node",
            "record_count",
            "first_ns",
            "last_ns",
            "created_at",
            "ingested_at",
            "attempts",
            "requeued_by",
            "requeued_at",
        ]
        read_only_fields = fields


class ShareSerializer(serializers.ModelSerializer):
    username = serializers.CharField(source="user.username", read_only=True)
    user_id = serializers.IntegerField(read_only=True)

    class Meta:
        model = WorkloadShare
        fields = ["user_id", "username", "level", "created_at"]
        read_only_fields = fields


class ShareRequestSerializer(serializers.Serializer):
    username = StrictCharField(max_length=150)
    level = serializers.ChoiceField(choices=ShareLevel.choices, default=ShareLevel.READ)
