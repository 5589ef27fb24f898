"""The API schema's shared parts (drf-spectacular hooks): the error answers every operation may give.

Every operation documents 400, 401, 403 and 404 with the body the API sends for them (``{"detail": …}``,
or field errors ``{"<field>": ["…"]}`` for a 400), so a client — or schemathesis — finds every status it
can meet in the schema: malformed bodies (400, see ``comminsight_site.parsers``), the machine API without a
token (401), a session API without a session or the right role (403), hidden or absent objects (404).
"""

from __future__ import annotations

from typing import Any

ERRORS = {
    "400": "The request is malformed: a field error per field, or `detail`",
    "401": "No valid credentials (the machine API answers with a `WWW-Authenticate: Bearer` challenge)",
    "403": "Not signed in, or not allowed (CSRF, role, share level)",
    "404": "No such object, or one you may not see",
}
ERROR_SCHEMA = {
    "type": "object",
    "description": "`detail` says why; a 400 may instead name each refused field with its messages",
    "properties": {"detail": {"type": "string"}},
    "additionalProperties": True,
}


def document_errors(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    """Add the shared error answers to every operation that does not describe them itself."""
    result.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
    reference = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    for methods in result.get("paths", {}).values():
        for operation in methods.values():
            responses = operation.setdefault("responses", {})
            for status, description in ERRORS.items():
                responses.setdefault(status, {"description": description, "content": reference})
    return result
