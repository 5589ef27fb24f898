"""``manage.py import_evidence``: import external evidence (Flight Recorder, Kineto, ...) into a workload."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.accounts.models import User
from apps.workloads.services import WorkloadError, evidence_import


class Command(BaseCommand):
    help = (
        "Import evidence any comminsight importer reads (a file or a directory) into the owner's workload, "
        "creating it when missing; the analyses read it like ingested archives."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("path", type=Path, help="evidence file or directory")
        parser.add_argument("--workload", required=True, help="workload id (external id); created when missing")
        parser.add_argument("--owner", required=True, help="user name owning the workload")
        parser.add_argument("--format", dest="fmt", help="importer name instead of detection (e.g. flight_recorder)")

    def handle(self, *args: Any, **options: Any) -> None:
        owner = User.objects.filter(username=options["owner"]).first()
        if owner is None:
            raise CommandError(f"no user named {options['owner']!r}")
        try:
            outcome = evidence_import(
                path=options["path"], workload_name=options["workload"], owner=owner, fmt=options["fmt"]
            )
        except WorkloadError as exc:
            raise CommandError(str(exc)) from exc
        workload = outcome.workload
        what = "created" if outcome.created else "added to"
        self.stdout.write(
            f"{what} workload {workload.pk} ({workload.external_id!r}, owner {owner.username}): "
            f"{outcome.rows} operations of {outcome.ranks} ranks on {len(outcome.nodes)} node(s) "
            f"({outcome.importer}), {len(outcome.files)} Parquet files"
        )
        self.stdout.write(f"analyse it: manage.py reanalyse {workload.pk}")
