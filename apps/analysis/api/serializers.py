"""Serializers of the analysis API."""

from __future__ import annotations

from rest_framework import serializers

from comminsight_site.fields import StrictBooleanField

from ..models import AnalysisJob, AnalysisKind


class AnalysisJobSerializer(serializers.ModelSerializer):
    created_by = serializers.CharField(source="created_by.username", default=None, read_only=True)
    result = serializers.SerializerMethodField()

    class Meta:
        model = AnalysisJob
        fields = [
            "id",
            "workload",
            "kind",
            "state",
            "progress",
            "partitions",
            "partitions_done",
            "parameters",
            "error",
            "created_by",
            "created_at",
            "started_at",
            "finished_at",
            "result",
        ]
        read_only_fields = fields

    def get_result(self, job: AnalysisJob) -> dict | None:
        """The library's JSON report (only in the detail view; lists leave it out)."""
        return job.result if self.context.get("with_result") else None


class AnalysisRequestSerializer(serializers.Serializer):
    kind = serializers.ChoiceField(choices=AnalysisKind.choices)
    parameters = serializers.DictField(required=False, default=dict, help_text="kind-specific; see docs/site.md")
    force = StrictBooleanField(required=False, default=False, help_text="run again even if a result is current")
