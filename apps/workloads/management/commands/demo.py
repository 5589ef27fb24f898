"""``manage.py demo``: run the demo job (a simulated 16-rank Megatron job, uploaded live by a real agent).

The site must be serving (``make run`` in another shell); the agent uploads to it like any agent would.
"""

from __future__ import annotations

from typing import Any

import httpx
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.accounts.models import Role, User
from apps.workloads.demo import DemoError, DemoPlan, demo_run, demo_workload_create


class Command(BaseCommand):
    help = (
        "Run the demo job: a simulated Megatron TP2 x PP2 x DP4 job (16 ranks, the real profiler plugin) whose "
        "agent uploads to this site live; one rank straggles, then another hangs."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--owner", help="user who owns the demo workload (default: root)")
        parser.add_argument(
            "--server-url",
            help="URL of this site as the agent reaches it (default: COMMINSIGHT_SERVER_PUBLIC_URL, else "
            "http://COMMINSIGHT_SERVER_LISTEN)",
        )
        defaults = DemoPlan()
        parser.add_argument("--steps", type=int, default=defaults.steps, help="training steps")
        parser.add_argument("--step-ms", type=float, default=defaults.step_ms, help="compute time per step (ms)")
        parser.add_argument("--hang-step", type=int, default=defaults.hang_step, help="step in which a rank hangs")
        parser.add_argument(
            "--hang-seconds",
            type=float,
            default=defaults.hang_s,
            help="seconds the job stays hung until aborted",
        )
        parser.add_argument("--no-analyses", action="store_true", help="do not queue the analyses at the end")

    def handle(self, *args: Any, **options: Any) -> None:
        owner = self._owner(options["owner"])
        server_url = (options["server_url"] or settings.PUBLIC_URL or f"http://{settings.SERVER_LISTEN}").rstrip("/")
        try:
            httpx.get(server_url + "/healthz", timeout=5).raise_for_status()
        except httpx.HTTPError as exc:
            raise CommandError(
                f"the site does not answer at {server_url} ({exc}); start it first (`make run`) or give --server-url"
            ) from exc
        try:
            plan = DemoPlan(
                steps=options["steps"],
                step_ms=options["step_ms"],
                hang_step=options["hang_step"],
                hang_s=options["hang_seconds"],
                straggler_from_step=min(DemoPlan.straggler_from_step, max(0, options["hang_step"] - 1)),
            )
            workload = demo_workload_create(owner=owner)
            self.stdout.write(f"Watch it live: {server_url}/workloads/{workload.pk}/")
            outcome = demo_run(
                workload=workload,
                page_url=server_url,
                plan=plan,
                say=self.stdout.write,
                analyse=not options["no_analyses"],
            )
        except DemoError as exc:
            raise CommandError(str(exc)) from exc
        outcome.workload.refresh_from_db()
        self.stdout.write(
            f"Done: workload {outcome.workload.external_id} is {outcome.workload.get_status_display().lower()}, "
            f"{outcome.archives} archives ingested. Open {server_url}/workloads/{outcome.workload.pk}/"
        )

    def _owner(self, username: str | None) -> User:
        if username:
            try:
                return User.objects.get(username=username, is_active=True)
            except User.DoesNotExist:
                raise CommandError(f"no active user {username!r}") from None
        root = User.objects.filter(role=Role.ROOT).first()
        if root is None:
            raise CommandError("the site is not initialised yet (open /init/ first), or give --owner")
        return root
