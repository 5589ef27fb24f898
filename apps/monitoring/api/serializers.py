"""API serializers of the monitoring app (documentation of the dashboard answer)."""

from __future__ import annotations

from rest_framework import serializers


class ChartSerializer(serializers.Serializer):
    metric = serializers.CharField()
    title = serializers.CharField()
    element_id = serializers.CharField()
    data = serializers.DictField(help_text="mode (lines|band), source_s, bucket_s, series, and lines or band")
    option = serializers.DictField(help_text="the ECharts option drawing it")


class DashboardSerializer(serializers.Serializer):
    start_ms = serializers.IntegerField()
    end_ms = serializers.IntegerField()
    live = serializers.BooleanField()
    charts = ChartSerializer(many=True)
