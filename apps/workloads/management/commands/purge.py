"""``manage.py purge``: delete workloads with everything they own (store, archives, analysis results)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.template.defaultfilters import filesizeformat

from apps.workloads.services import WorkloadError, workloads_purge


class Command(BaseCommand):
    help = "Delete workloads by id or by age; lists them first and deletes only with --yes."

    def add_arguments(self, parser: CommandParser) -> None:
        selector = parser.add_mutually_exclusive_group(required=True)
        selector.add_argument("--workload", type=int, action="append", metavar="ID", help="workload id (repeatable)")
        selector.add_argument(
            "--older-than", type=float, metavar="DAYS", help="workloads with no activity for this many days"
        )
        parser.add_argument("--dry-run", action="store_true", help="list what would be deleted; delete nothing")
        parser.add_argument("--yes", action="store_true", help="delete without asking")

    def handle(self, *args: Any, **options: Any) -> None:
        dry_run = options["dry_run"] or not options["yes"]
        try:
            matched = workloads_purge(
                workload_ids=options["workload"], older_than_days=options["older_than"], dry_run=dry_run
            )
        except WorkloadError as exc:
            raise CommandError(str(exc)) from exc
        verb = "would delete" if dry_run else "deleted"
        for c in matched:
            self.stdout.write(
                f"{verb} workload {c.workload_id} {c.name!r} (owner {c.owner}, last activity "
                f"{c.last_activity:%Y-%m-%d %H:%M}Z, {c.archives} archives, store {filesizeformat(c.store_bytes)})"
            )
        self.stdout.write(f"{verb} {len(matched)} workload(s)")
        if dry_run and not options["dry_run"] and matched:
            raise CommandError("nothing deleted: run again with --yes to delete (or --dry-run to only list)")
