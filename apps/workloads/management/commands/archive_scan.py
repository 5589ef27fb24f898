"""``manage.py archive_scan``: run the archive discovery scan once now (what the periodic task runs)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.workloads.discovery import discovery_scan


class Command(BaseCommand):
    help = "Scan <archive path>/comminsight/02_archives once: register new archives and queue their ingest."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--path", help="archive path to scan this once instead of System Settings' (the setting is unchanged)"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        scan = discovery_scan(options["path"])
        if scan.problem:
            raise CommandError(scan.problem)
        self.stdout.write(f"scanned {scan.root} (owner of new archives: {scan.owner})")
        for path in scan.queued:
            self.stdout.write(f"queued   {path}")
        for path in scan.known:
            self.stdout.write(f"known    {path}")
        for path, why in scan.skipped:
            self.stdout.write(f"skipped  {path}: {why}")
        self.stdout.write(
            f"found {scan.found}: {len(scan.queued)} queued for ingest, {len(scan.known)} already registered, "
            f"{len(scan.skipped)} skipped"
        )
