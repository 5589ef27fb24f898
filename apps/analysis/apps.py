"""App config: analysis jobs, results and live progress (filled in by the analysis issues)."""

from django.apps import AppConfig


class AnalysisConfig(AppConfig):
    name = "apps.analysis"
    label = "analysis"
    verbose_name = "Analysis"
