"""App config: workloads, nodes, ranks, communicators, archives, shares; ingest API; discovery."""

from django.apps import AppConfig


class WorkloadsConfig(AppConfig):
    name = "apps.workloads"
    label = "workloads"
    verbose_name = "Workloads"
