"""Analysis jobs API (``/api/v1/workloads/<id>/analyses/``). Every view starts from the one visibility rule."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from .. import selectors, services
from .serializers import AnalysisJobSerializer, AnalysisRequestSerializer


class AnalysisListView(APIView):
    @extend_schema(responses=AnalysisJobSerializer(many=True), summary="Analysis jobs of a workload")
    def get(self, request: Request, workload_id: int) -> Response:
        workload = selectors.visible_workload(request.user, workload_id)
        return Response(AnalysisJobSerializer(selectors.workload_jobs(workload), many=True).data)

    @extend_schema(
        request=AnalysisRequestSerializer,
        responses={201: AnalysisJobSerializer, 200: AnalysisJobSerializer},
        summary="Request an analysis (201: new job; 200: the existing job answers or was queued again)",
    )
    def post(self, request: Request, workload_id: int) -> Response:
        workload = selectors.visible_workload(request.user, workload_id)
        body = AnalysisRequestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            outcome = services.analysis_request(
                workload,
                body.validated_data["kind"],
                request.user,
                body.validated_data["parameters"],
                force=body.validated_data["force"],
            )
        except services.AnalysisParameterError as exc:
            raise ValidationError(exc.errors) from exc
        code = status.HTTP_201_CREATED if outcome.created else status.HTTP_200_OK
        return Response(AnalysisJobSerializer(outcome.job).data, status=code)


class AnalysisDetailView(APIView):
    @extend_schema(responses=AnalysisJobSerializer, summary="One analysis job, with its result when done")
    def get(self, request: Request, workload_id: int, job_id: int) -> Response:
        job = selectors.visible_job(request.user, workload_id, job_id)
        return Response(AnalysisJobSerializer(job, context={"with_result": True}).data)
