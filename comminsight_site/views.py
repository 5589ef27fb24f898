"""Site-wide endpoints that belong to no app: the liveness probe and the icon browsers ask for."""

from __future__ import annotations

from collections.abc import Callable

from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.cache import cache_control
from django.views.decorators.http import require_GET
from django.views.defaults import page_not_found


@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    """200 when the database answers; load balancers and `make run` users poll this."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return JsonResponse({"status": "ok"})


# The brand mark (a diamond) as the site's icon; browsers ask for /favicon.ico on every page.
FAVICON_SVG = (
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 32 32">'
    '<rect width="32" height="32" rx="6" fill="#111827"/>'
    '<path d="M16 5 27 16 16 27 5 16Z" fill="#7c9cff"/></svg>'
)


@require_GET
@cache_control(max_age=86400, public=True)
def favicon(request: HttpRequest) -> HttpResponse:
    return HttpResponse(FAVICON_SVG, content_type="image/svg+xml")


# Methods the site answers at all; anything else (TRACE, CONNECT, made-up verbs) is a 405 before routing.
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class UnknownMethodMiddleware:
    """TRACE and unknown methods answer 405 with a JSON reason on every path, before any view or permission
    check runs (a 404 from a hidden object would otherwise say more than "not allowed")."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.method not in KNOWN_METHODS:
            response = JsonResponse({"detail": f'Method "{request.method}" not allowed.'}, status=405)
            response["Allow"] = ", ".join(sorted(KNOWN_METHODS))
            return response
        return self.get_response(request)


def not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    """404: JSON under /api/ (what the schema documents), the site's page elsewhere."""
    if request.path.startswith("/api/"):
        return JsonResponse({"detail": "Not found."}, status=404)
    return page_not_found(request, exception)
