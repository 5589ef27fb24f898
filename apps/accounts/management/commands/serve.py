"""``manage.py serve``: what `make run` starts — migrate, collect static files when needed, make sure a
bootstrap token exists while the site has no root (printing the token file's *path*), then run Daphne
on ``COMMINSIGHT_SERVER_LISTEN`` (and ``COMMINSIGHT_SERVER_AGENT_LISTEN`` when set).
"""

from __future__ import annotations

import functools
import logging
import threading

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import close_old_connections

from apps.accounts import services


def daphne_endpoint(listen: str) -> str:
    """Twisted endpoint string for ``host:port`` (IPv6 hosts in brackets)."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise CommandError(f"listen address must look like HOST:PORT, not {listen!r}")
    host = host.strip("[]").replace(":", r"\:")
    return f"tcp:port={port}:interface={host}"


logger = logging.getLogger(__name__)

REQUEST_BUFFER_BYTES = 256 * 1024


def embedded_periodic_tasks(stop: threading.Event) -> None:
    """Without Redis there is no celery beat: run discovery and the lost-workload check in a thread."""
    from apps.workloads import discovery, ingest, live, uploads

    while not stop.wait(settings.DISCOVERY_INTERVAL_S):
        try:
            discovery.discover_archives()
            live.mark_lost_workloads()
            for archive_id in ingest.stale_stored_archives():
                ingest.archive_ingest(archive_id)
            uploads.uploads_expire()
        except Exception:  # one bad scan must not end the loop
            logger.exception("periodic discovery failed")
        finally:
            close_old_connections()


class Command(BaseCommand):
    help = "Prepare the site (migrate, static files, bootstrap token) and serve it with Daphne."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--listen", default=settings.SERVER_LISTEN, help="HOST:PORT (COMMINSIGHT_SERVER_LISTEN)")
        parser.add_argument("--no-migrate", action="store_true", help="do not apply migrations first")
        parser.add_argument("--prepare-only", action="store_true", help="do everything except start the server")

    def handle(self, *args: object, **options: object) -> None:
        settings.DATA_DIR.mkdir(parents=True, exist_ok=True)
        if not options["no_migrate"]:
            call_command("migrate", interactive=False, verbosity=0)
        # Development serves static files through the finders; production needs the hashed collection.
        if settings.PRODUCTION:
            call_command("collectstatic", interactive=False, verbosity=0)
        path = services.bootstrap_ensure()
        listen = str(options["listen"])
        if path is not None:
            self.stdout.write(
                f"CommInsight is not initialised yet. Open http://{listen}/init/ and paste the one-time token "
                f"stored in {path}"
            )
        endpoints = [daphne_endpoint(listen)]
        if settings.SERVER_AGENT_LISTEN:
            endpoints.append(daphne_endpoint(settings.SERVER_AGENT_LISTEN))
        self.stdout.write(f"serving on {', '.join(endpoints)} (data in {settings.DATA_DIR})")
        if options["prepare_only"]:
            return
        from daphne.cli import CommandLineInterface

        if settings.CELERY_TASK_ALWAYS_EAGER:
            threading.Thread(
                target=embedded_periodic_tasks, args=(threading.Event(),), name="comminsight-periodic", daemon=True
            ).start()

        argv = [arg for endpoint in endpoints for arg in ("-e", endpoint)]
        application = settings.ASGI_APPLICATION.rpartition(".")
        cli = CommandLineInterface()
        # Daphne hands a request body to the application in request_buffer_size pieces (8 KiB by default, not a
        # command-line option): an 8 MiB upload chunk became 1024 queue messages on the one event loop.
        cli.server_class = functools.partial(cli.server_class, request_buffer_size=REQUEST_BUFFER_BYTES)
        cli.run([*argv, f"{application[0]}:{application[2]}"])
