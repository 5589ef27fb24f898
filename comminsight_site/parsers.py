"""The API's JSON parser: every JSON request body is parsed with a size and a nesting-depth limit.

DRF's own ``JSONParser`` uses the standard library's recursive decoder, so a body nested 200,000 levels
deep raised ``RecursionError`` and answered 500. This parser reads at most ``API_JSON_MAX_BYTES`` (+1 to
tell "too large" apart) and parses through ``comminsight.formats.boundedjson`` — the same helper the archive
ingest and the agents use — so a bad body is a 400 (413 when too large) with a one-line ``detail``.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from rest_framework import status
from rest_framework.exceptions import APIException, ParseError
from rest_framework.parsers import JSONParser

from comminsight.formats.boundedjson import JSONLimitError, loads_bounded


class RequestBodyTooLarge(APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_detail = "request body too large"
    default_code = "too_large"


class BoundedJSONParser(JSONParser):
    """``application/json`` bodies, refused with 400 when malformed or nested deeper than the limit."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: dict | None = None) -> Any:
        limit = settings.API_JSON_MAX_BYTES
        raw = stream.read(limit + 1) if stream is not None else b""
        if len(raw) > limit:
            raise RequestBodyTooLarge(f"request body is larger than {limit} bytes")
        try:
            return loads_bounded(raw, what="request body", max_bytes=limit, max_depth=settings.API_JSON_MAX_DEPTH)
        except JSONLimitError as exc:
            raise ParseError(str(exc)) from None
