"""App config: time series of live heartbeats and archive-derived summaries, and the dashboards that draw them."""

from django.apps import AppConfig


class MonitoringConfig(AppConfig):
    name = "apps.monitoring"
    label = "monitoring"
    verbose_name = "Monitoring"

    def ready(self) -> None:
        from . import signals  # noqa: F401  (connects the receivers)
