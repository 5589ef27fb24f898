"""``GET /api/v1/workloads/<id>/monitoring/``: a workload's dashboard charts over a time range, downsampled."""

from __future__ import annotations

from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.workloads.selectors import workloads_visible_to

from .. import selectors
from ..metrics import METRICS
from .serializers import DashboardSerializer


class WorkloadMonitoringView(APIView):
    @extend_schema(
        parameters=[
            OpenApiParameter("range", OpenApiTypes.STR, enum=list(selectors.PRESETS), description="preset range"),
            OpenApiParameter("from", OpenApiTypes.DATETIME, description="explicit start (ISO 8601)"),
            OpenApiParameter("to", OpenApiTypes.DATETIME, description="explicit end (ISO 8601; default now)"),
            OpenApiParameter(
                "metrics", OpenApiTypes.STR, description=f"comma-separated subset of {', '.join(METRICS)}"
            ),
        ],
        responses={
            200: DashboardSerializer,
            400: inline_serializer("MonitoringProblem", {"detail": serializers.CharField()}),
        },
        summary="Dashboard charts of a workload",
    )
    def get(self, request: Request, workload_id: int) -> Response:
        workload = get_object_or_404(workloads_visible_to(request.user), pk=workload_id)
        try:
            span = selectors.time_range(request.query_params)
        except selectors.RangeError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_400_BAD_REQUEST)
        metrics = None
        if request.query_params.get("metrics"):
            metrics = request.query_params["metrics"].split(",")[:50]
            unknown = [m for m in metrics if m not in METRICS]
            if unknown:
                return Response({"detail": f"unknown metrics: {', '.join(unknown[:5])}"}, status=400)
        charts = selectors.dashboard(workload, span, metrics)
        return Response({"start_ms": span.start_ms, "end_ms": span.end_ms, "live": span.live, "charts": charts})
