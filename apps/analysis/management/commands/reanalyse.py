"""``manage.py reanalyse``: queue analyses of workloads again (after an upgrade of the library, for example)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.analysis.models import AnalysisKind
from apps.analysis.services import AnalysisParameterError, analysis_request
from apps.workloads.models import Workload


class Command(BaseCommand):
    help = "Queue analyses of workloads (default parameters); done jobs whose store is unchanged need --force."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("workloads", nargs="*", type=int, help="workload ids (default: every workload)")
        parser.add_argument("--kind", action="append", choices=AnalysisKind.values, help="repeatable; default all")
        parser.add_argument("--force", action="store_true", help="run again even when a result is current")

    def handle(self, *args: Any, **options: Any) -> None:
        workloads = Workload.objects.order_by("pk")
        if options["workloads"]:
            workloads = workloads.filter(pk__in=options["workloads"])
            missing = set(options["workloads"]) - set(workloads.values_list("pk", flat=True))
            if missing:
                raise CommandError(f"no workload with id {', '.join(map(str, sorted(missing)))}")
        kinds = options["kind"] or list(AnalysisKind.values)
        for workload in workloads:
            for kind in kinds:
                try:
                    outcome = analysis_request(workload, kind, None, {}, force=options["force"])
                except AnalysisParameterError as exc:  # pragma: no cover - defaults are always valid
                    raise CommandError(str(exc)) from exc
                job = outcome.job
                job.refresh_from_db()
                what = "queued" if outcome.queued else "current, left alone"
                self.stdout.write(f"workload {workload.pk} {kind}: job {job.pk} {what} (state {job.state})")
