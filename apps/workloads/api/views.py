"""Workloads API. Every view starts from ``workloads_visible_to``: hidden workloads answer 404."""

from __future__ import annotations

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.exceptions import PermissionDenied, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.accounts.models import User
from apps.workloads import services
from apps.workloads.ingest import RequeueRefused
from apps.workloads.models import ArchiveState, Workload
from apps.workloads.selectors import (
    archives_visible_to,
    workload_can_manage,
    workloads_visible_to,
    workloads_with_counts,
)

from .serializers import ArchiveSerializer, ShareRequestSerializer, ShareSerializer, WorkloadSerializer


def _visible_workload(request: Request, workload_id: int) -> Workload:
    return get_object_or_404(workloads_visible_to(request.user), pk=workload_id)


class WorkloadListView(APIView):
    @extend_schema(responses=WorkloadSerializer(many=True), summary="Workloads you may see")
    def get(self, request: Request) -> Response:
        return Response(WorkloadSerializer(workloads_with_counts(workloads_visible_to(request.user)), many=True).data)


class WorkloadDetailView(APIView):
    @extend_schema(responses=WorkloadSerializer, summary="One workload")
    def get(self, request: Request, workload_id: int) -> Response:
        # The same counts as the list (nodes, ranks, archives), never null.
        workload = get_object_or_404(workloads_with_counts(workloads_visible_to(request.user)), pk=workload_id)
        return Response(WorkloadSerializer(workload).data)

    @extend_schema(responses={204: None}, summary="Delete a workload (manage level or administrator)")
    def delete(self, request: Request, workload_id: int) -> Response:
        workload = _visible_workload(request, workload_id)
        try:
            services.workload_delete(actor=request.user, workload=workload)
        except services.WorkloadPermissionDenied as exc:
            raise PermissionDenied(str(exc)) from exc
        return Response(status=status.HTTP_204_NO_CONTENT)


class WorkloadShareListView(APIView):
    @extend_schema(responses=ShareSerializer(many=True), summary="Who the workload is shared with (manage level)")
    def get(self, request: Request, workload_id: int) -> Response:
        workload = _visible_workload(request, workload_id)
        if not workload_can_manage(request.user, workload):
            raise PermissionDenied("You need the manage level on this workload to see its shares.")
        shares = workload.shares.select_related("user").order_by("user__username")
        return Response(ShareSerializer(shares, many=True).data)

    @extend_schema(request=ShareRequestSerializer, responses={201: ShareSerializer}, summary="Share with a user")
    def post(self, request: Request, workload_id: int) -> Response:
        workload = _visible_workload(request, workload_id)
        body = ShareRequestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        if not workload_can_manage(request.user, workload):
            raise PermissionDenied("You need the manage level on this workload to share it.")
        user = User.objects.filter(username=body.validated_data["username"], is_active=True).first()
        if user is None:
            raise ValidationError({"username": "No active user with that name."})
        try:
            share = services.workload_share(
                actor=request.user, workload=workload, user=user, level=body.validated_data["level"]
            )
        except services.WorkloadError as exc:
            raise ValidationError({"detail": str(exc)}) from exc
        return Response(ShareSerializer(share).data, status=status.HTTP_201_CREATED)


class WorkloadShareDetailView(APIView):
    @extend_schema(responses={204: None}, summary="Unshare (manage level or administrator)")
    def delete(self, request: Request, workload_id: int, user_id: int) -> Response:
        workload = _visible_workload(request, workload_id)
        user = get_object_or_404(User, pk=user_id)
        try:
            removed = services.workload_unshare(actor=request.user, workload=workload, user=user)
        except services.WorkloadPermissionDenied as exc:
            raise PermissionDenied(str(exc)) from exc
        if not removed:
            return Response({"detail": "That user had no share."}, status=status.HTTP_404_NOT_FOUND)
        return Response(status=status.HTTP_204_NO_CONTENT)


class WorkloadArchiveListView(APIView):
    @extend_schema(responses=ArchiveSerializer(many=True), summary="Archives of a workload, with state and reason")
    def get(self, request: Request, workload_id: int) -> Response:
        workload = _visible_workload(request, workload_id)
        return Response(ArchiveSerializer(workload.archives.order_by("-created_at"), many=True).data)


class ArchiveListView(APIView):
    @extend_schema(
        parameters=[
            OpenApiParameter("state", str, enum=ArchiveState.values, description="only archives in this state")
        ],
        responses=ArchiveSerializer(many=True),
        summary="Your archives (all for administrators), with state, attempts and the reason of a refusal",
    )
    def get(self, request: Request) -> Response:
        archives = archives_visible_to(request.user).order_by("-created_at")
        state = request.query_params.get("state")
        if state is not None:
            if state not in ArchiveState.values:
                raise ValidationError({"state": f"one of {', '.join(ArchiveState.values)}"})
            archives = archives.filter(state=state)
        return Response(ArchiveSerializer(archives[:1000], many=True).data)


class ArchiveRequeueView(APIView):
    @extend_schema(
        request=None,
        responses={
            200: ArchiveSerializer,
            409: inline_serializer("RequeueRefused", {"detail": serializers.CharField()}),
        },
        summary="Put a quarantined or cancelled archive back in the ingest queue (administrators)",
        description=(
            "The archive is stored again with its attempts counted from 0 and `requeued_by`/`requeued_at` set, "
            "and its ingest is queued. Asking again while it waits or is being ingested changes nothing (200). "
            "409 when it is already ingested or its stored bytes are gone or changed. The owner may see the "
            "archive but gets 403; anyone else 404."
        ),
    )
    def post(self, request: Request, archive_id: int) -> Response:
        archive = get_object_or_404(archives_visible_to(request.user), pk=archive_id)
        try:
            services.archive_ingest_requeue(actor=request.user, archive=archive)
        except services.WorkloadPermissionDenied as exc:
            raise PermissionDenied(str(exc)) from exc
        except RequeueRefused as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
        archive.refresh_from_db()
        return Response(ArchiveSerializer(archive).data)
