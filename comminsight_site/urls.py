"""Top-level URLconf. Every route has a name: the permission matrix test enumerates them all."""

from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from .views import favicon, healthz

handler404 = "comminsight_site.views.not_found"

urlpatterns = [
    path("healthz", healthz, name="healthz"),
    path("favicon.ico", favicon, name="favicon"),
    path("", include("apps.accounts.urls")),
    path("", include("apps.workloads.urls")),
    path("", include("apps.analysis.urls")),
    path("", include("apps.monitoring.urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="api-schema"), name="api-docs"),
    path("api/v1/", include("apps.accounts.api.urls")),
    path("api/v1/", include("apps.workloads.api.urls")),
    path("api/v1/", include("apps.analysis.api.urls")),
    path("api/v1/", include("apps.monitoring.api.urls")),
]
