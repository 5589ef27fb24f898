"""Site-wide endpoints that belong to no app: the liveness probe and the icon browsers ask for."""

from __future__ import annotations

from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.cache import cache_control
from django.views.decorators.http import require_GET


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
