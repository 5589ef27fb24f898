"""The agents' machine API (``/api/v1/ingest/``), protocol v1 in docs/formats/upload.md.

Authenticated by agent tokens only (``Authorization: Bearer ci_…``); sessions are not accepted here.
Each view parses the request, calls one function in ``uploads`` or ``live``, and renders the answer.
"""

from __future__ import annotations

import threading
import uuid

from django.conf import settings
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, inline_serializer
from rest_framework import parsers, serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.utils.serializer_helpers import BindingDict
from rest_framework.views import APIView

from apps.accounts.authentication import AgentTokenAuthentication, HasIngestToken
from apps.workloads import live, uploads
from apps.workloads.models import Archive, Upload
from comminsight_site.fields import StrictBooleanField, StrictCharField, StrictIntegerField, StrictRegexField
from comminsight_site.permissions import MethodAllowed

from .throttling import IngestRateThrottle

ArchiveDone = inline_serializer(
    "ArchiveDone",
    {"status": serializers.CharField(), "sha256": serializers.CharField(), "archive_id": serializers.IntegerField()},
)
UploadOpen = inline_serializer(
    "UploadOpen",
    {
        "upload_id": serializers.UUIDField(),
        "offset": serializers.IntegerField(),
        "max_chunk": serializers.IntegerField(),
        "status": serializers.CharField(),
    },
)
Problem = inline_serializer("IngestProblem", {"detail": serializers.CharField()})
StorageFull = inline_serializer(
    "IngestStorageFull", {"detail": serializers.CharField(), "reason": serializers.CharField()}
)


# A serializer whose bound fields are built once per thread and class, then reused. (No docstring: the API
# schema would show it as the description of every such serializer.) DRF deep-copies every declared field for
# each serializer instance, so that one instance may change its own; these serializers never do, and for a
# heartbeat (nested communicator fields) the copy cost more CPU than the validation. The fields stay bound to
# the thread's first instance, which differs from a later one in nothing a field reads (no context, never
# partial); one thread validates one request at a time.
class FieldsOncePerThread(serializers.Serializer):
    _built = threading.local()

    @property
    def fields(self) -> BindingDict:  # type: ignore[override]
        built = self._built.__dict__
        fields = built.get(type(self))
        if fields is None:
            fields = built[type(self)] = BindingDict(self)
            for name, field in self.get_fields().items():
                fields[name] = field
        return fields


class UploadCreateSerializer(FieldsOncePerThread):
    sha256 = StrictRegexField(r"^[0-9a-f]{64}$")
    size = StrictIntegerField(min_value=1)
    filename = StrictRegexField(r"^[A-Za-z0-9._-]{1,255}$", max_length=255)
    workload_id = StrictCharField(max_length=200, required=False, allow_blank=True, default="")
    node = StrictCharField(max_length=200, required=False, allow_blank=True, default="")


class OneShotSerializer(serializers.Serializer):
    file = serializers.FileField()
    sha256 = serializers.RegexField(r"^[0-9a-f]{64}$")


class CommunicatorLiveSerializer(serializers.Serializer):
    comm_hash = StrictCharField(max_length=64)
    nranks = StrictIntegerField(min_value=0, required=False, default=0)
    last_completed_seq = StrictIntegerField(min_value=-1, required=False, default=-1)
    lagging_ranks = serializers.ListField(child=StrictIntegerField(), max_length=1 << 16, required=False)
    inflight = StrictIntegerField(min_value=0, required=False, default=0)
    # Members by index inside the communicator: {"<index>": {"global_rank": g, ...}}; lagging_ranks are indices.
    ranks = serializers.DictField(child=serializers.JSONField(), required=False)


class HeartbeatSerializer(FieldsOncePerThread):
    workload_id = StrictCharField(max_length=200)
    node = StrictCharField(max_length=200)
    host = StrictCharField(max_length=200, required=False, allow_blank=True, default="")
    agent_version = StrictCharField(max_length=64, required=False, allow_blank=True, default="")
    sent_ns = StrictIntegerField(min_value=0, required=False)
    ranks = serializers.ListField(child=StrictIntegerField(min_value=-1), max_length=1 << 20, required=False)
    communicators = serializers.ListField(child=CommunicatorLiveSerializer(), max_length=100_000, required=False)
    hang = serializers.JSONField(required=False, allow_null=True, default=None)
    finished = StrictBooleanField(required=False, default=False)
    # Measurements (docs/formats/upload.md, "Live heartbeat"): shapes checked here, values by apps.monitoring,
    # which skips an unusable value with a log line rather than refuse the heartbeat's progress with it.
    steps = serializers.ListField(child=serializers.DictField(), max_length=1 << 16, required=False, allow_null=True)
    devices = serializers.ListField(child=serializers.DictField(), max_length=4096, required=False, allow_null=True)
    nics = serializers.ListField(child=serializers.DictField(), max_length=4096, required=False, allow_null=True)
    agent = serializers.DictField(required=False, allow_null=True)
    # Diagnosis evidence while a hang is suspected: per node, base64 records and pid -> global rank
    # (docs/formats/upload.md); decoded and checksum-verified by the worker that merges the root cause.
    evidence = serializers.ListField(child=serializers.DictField(), max_length=4096, required=False, allow_null=True)


def _problem(exc: uploads.UploadError) -> Response:
    return Response({"detail": exc.detail, **exc.extra}, status=exc.status)


def complete_body(archive: Archive) -> dict[str, object]:
    """The ``ArchiveDone`` answer (also given by ``agent_requests``)."""
    return {"status": "complete", "sha256": archive.sha256, "archive_id": archive.pk}


def open_body(upload: Upload) -> dict[str, object]:
    """The ``UploadOpen`` answer (also given by ``agent_requests``)."""
    return {
        "upload_id": str(upload.id),
        "offset": upload.offset,
        "max_chunk": settings.INGEST_MAX_CHUNK_BYTES,
        "status": "open",
    }


def _complete(archive: Archive, created: bool) -> Response:
    return Response(complete_body(archive), status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)


def _open(upload: Upload, created: bool) -> Response:
    return Response(open_body(upload), status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)


def _content_length(request: Request) -> int:
    try:
        return int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return -1


class IngestView(APIView):
    authentication_classes = [AgentTokenAuthentication]
    permission_classes = [MethodAllowed, HasIngestToken]
    throttle_classes = [IngestRateThrottle]
    throttle_scope = "ingest"


class UploadCreateView(IngestView):
    @extend_schema(
        request=UploadCreateSerializer,
        responses={
            201: UploadOpen,
            200: OpenApiResponse(description="resume (UploadOpen) or already stored (ArchiveDone)"),
            413: Problem,
            507: StorageFull,
        },
        summary="Start (or resume) a resumable archive upload",
    )
    def post(self, request: Request) -> Response:
        body = UploadCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            outcome = uploads.upload_create(token=request.auth, **body.validated_data)
        except uploads.UploadError as exc:
            return _problem(exc)
        if outcome.archive is not None:
            return _complete(outcome.archive, created=False)
        return _open(outcome.upload, outcome.created)


class OctetStreamParser(parsers.BaseParser):
    """Declares the chunk media type; the view streams the body itself and never calls this parser."""

    media_type = "application/offset+octet-stream"

    def parse(self, stream, media_type=None, parser_context=None):
        return stream


class UploadDetailView(IngestView):
    parser_classes = [OctetStreamParser]

    @extend_schema(
        responses={200: OpenApiResponse(description="headers Upload-Offset and Upload-Length")},
        summary="Current offset of an upload (after a disconnect)",
    )
    def head(self, request: Request, upload_id: uuid.UUID) -> Response:
        upload = uploads.upload_get(owner=request.user, upload_id=upload_id)
        if upload is None:
            return Response(status=status.HTTP_404_NOT_FOUND)
        return Response(
            headers={
                "Upload-Offset": str(upload.offset),
                "Upload-Length": str(upload.size),
                "Cache-Control": "no-store",
            }
        )

    @extend_schema(
        request={"application/offset+octet-stream": OpenApiTypes.BINARY},
        parameters=[
            OpenApiParameter("Upload-Offset", int, OpenApiParameter.HEADER, required=True),
            OpenApiParameter(
                "Upload-Checksum", str, OpenApiParameter.HEADER, required=True, description="sha256 <hex>"
            ),
        ],
        responses={204: None, 408: Problem, 409: Problem, 413: Problem, 422: Problem, 507: StorageFull},
        summary="Append one chunk at the given offset",
    )
    def patch(self, request: Request, upload_id: uuid.UUID) -> Response:
        try:
            offset = int(request.headers.get("Upload-Offset", ""))
        except ValueError:
            return Response({"detail": "Upload-Offset header must be an integer"}, status=status.HTTP_400_BAD_REQUEST)
        length = _content_length(request)
        if length < 0:
            return Response({"detail": "bad Content-Length"}, status=status.HTTP_400_BAD_REQUEST)
        try:
            upload = uploads.upload_append(
                owner=request.user,
                upload_id=upload_id,
                offset=offset,
                checksum=request.headers.get("Upload-Checksum"),
                length=length,
                body=request.stream if length else _Empty(),
            )
        except uploads.UploadError as exc:
            return _problem(exc)
        return Response(status=status.HTTP_204_NO_CONTENT, headers={"Upload-Offset": str(upload.offset)})


class _Empty:
    def read(self, size: int = -1) -> bytes:
        return b""


class UploadFinalizeView(IngestView):
    @extend_schema(
        request=None,
        responses={201: ArchiveDone, 200: ArchiveDone, 409: Problem, 422: Problem, 507: StorageFull},
        summary="Verify the whole sha256 and store the archive (ingest is queued)",
    )
    def post(self, request: Request, upload_id: uuid.UUID) -> Response:
        try:
            archive, created = uploads.upload_finalize(owner=request.user, upload_id=upload_id)
        except uploads.UploadError as exc:
            return _problem(exc)
        return _complete(archive, created)


class OneShotUploadView(IngestView):
    parser_classes = [parsers.MultiPartParser]

    @extend_schema(
        request={"multipart/form-data": OneShotSerializer},
        responses={201: ArchiveDone, 200: ArchiveDone, 408: Problem, 413: Problem, 422: Problem, 507: StorageFull},
        summary="Upload a small archive in one multipart request",
    )
    def post(self, request: Request) -> Response:
        # Refuse before the multipart parser touches the body.
        if _content_length(request) > settings.INGEST_MAX_ONESHOT_BYTES + 64 * 1024:
            return Response(
                {"detail": f"one-shot uploads are limited to {settings.INGEST_MAX_ONESHOT_BYTES} bytes"},
                status=status.HTTP_413_REQUEST_ENTITY_TOO_LARGE,
            )
        try:
            with uploads.disk_full_as_507():  # the multipart parser spools the file to disk
                body = OneShotSerializer(data=request.data)
                body.is_valid(raise_exception=True)
        except uploads.UploadError as exc:
            return _problem(exc)
        upload = body.validated_data["file"]
        try:
            archive, created = uploads.upload_oneshot(
                token=request.auth,
                sha256=body.validated_data["sha256"],
                filename=upload.name,
                body=upload,
                length=upload.size,
            )
        except uploads.UploadError as exc:
            return _problem(exc)
        return _complete(archive, created)


class LiveView(IngestView):
    @extend_schema(
        request=HeartbeatSerializer,
        responses={202: inline_serializer("LiveAccepted", {"status": serializers.CharField()}), 413: Problem},
        summary="Post a heartbeat with live progress",
    )
    def post(self, request: Request) -> Response:
        if _content_length(request) > settings.INGEST_LIVE_MAX_BYTES:
            return Response({"detail": "heartbeat too large"}, status=status.HTTP_413_REQUEST_ENTITY_TOO_LARGE)
        body = HeartbeatSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        workload = live.live_record_heartbeat(token=request.auth, heartbeat=body.validated_data)
        return Response({"status": workload.status}, status=status.HTTP_202_ACCEPTED)
