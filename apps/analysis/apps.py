"""App config: analysis jobs, results, live progress, Step calibration and trace export."""

from django.apps import AppConfig


class AnalysisConfig(AppConfig):
    name = "apps.analysis"
    label = "analysis"
    verbose_name = "Analysis"

    def ready(self) -> None:
        from . import signals  # noqa: F401  (connects the receivers)
