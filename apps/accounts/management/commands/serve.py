"""``manage.py serve``: what `make run` starts — migrate, collect static files when needed, make sure a
bootstrap token exists while the site has no root (printing the token file's *path*), then serve HTTP and
WebSockets on ``COMMINSIGHT_SERVER_LISTEN`` (and ``COMMINSIGHT_SERVER_AGENT_LISTEN`` when set) with uvicorn
(``comminsight_site.uvicorn_serving``), or with Daphne when ``COMMINSIGHT_SERVER_HTTP=daphne`` (and always
when ``COMMINSIGHT_SERVER_STREAM_BODIES`` is off: stock Daphne, which buffers each body).

``--workers N`` (``COMMINSIGHT_SERVER_WORKERS``) binds the listening sockets once and starts N server
processes that all accept on them (the kernel spreads connections): one Python process runs one request's
Python code at a time, so more cores need more processes.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import close_old_connections

from apps.accounts import services
from comminsight import lifeline


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
    help = "Prepare the site (migrate, static files, bootstrap token) and serve it (uvicorn, or Daphne)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--listen", default=settings.SERVER_LISTEN, help="HOST:PORT (COMMINSIGHT_SERVER_LISTEN)")
        parser.add_argument("--no-migrate", action="store_true", help="do not apply migrations first")
        parser.add_argument("--prepare-only", action="store_true", help="do everything except start the server")
        parser.add_argument(
            "--workers",
            type=int,
            default=_env_workers(),
            help="server processes sharing the listening sockets (COMMINSIGHT_SERVER_WORKERS, default 1)",
        )
        # Internal: a worker started by --workers serves on inherited sockets and prepares nothing.
        parser.add_argument("--inherit-fd", action="append", default=[], help=argparse.SUPPRESS)

    def handle(self, *args: object, **options: object) -> None:
        if options["inherit_fd"]:  # a worker of run_workers: it ends with its parent, even a killed one
            lifeline.watch_parent()
            inherited = list(map(_fd_spec, options["inherit_fd"]))
            if _uvicorn():
                run_uvicorn([_adopt(fd, domain) for fd, domain in inherited])
            else:
                run_daphne([f"{ADOPT}:{fd}:{domain}" for fd, domain in inherited])
            return
        workers = int(options["workers"])
        if workers < 1:
            raise CommandError("--workers must be at least 1")
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
        self.stdout.write(
            f"Open http://{listen}/ in a browser. Nothing to look at yet? The empty workload list offers "
            "'Run a demo job' (or run `manage.py demo` in another shell)."
        )
        if options["prepare_only"]:
            return
        if settings.CELERY_TASK_ALWAYS_EAGER:
            threading.Thread(
                target=embedded_periodic_tasks, args=(threading.Event(),), name="comminsight-periodic", daemon=True
            ).start()

        addresses = [listen] + ([settings.SERVER_AGENT_LISTEN] if settings.SERVER_AGENT_LISTEN else [])
        if workers == 1 and _uvicorn():
            run_uvicorn([bind(address) for address in addresses])
        elif workers == 1:
            run_daphne(endpoints)
        else:
            run_workers(workers, [bind(address) for address in addresses])


def _uvicorn() -> bool:
    """uvicorn serves, unless Daphne is asked for, or streaming is off (the stock Daphne baseline)."""
    return settings.SERVER_HTTP == "uvicorn" and settings.SERVER_STREAM_BODIES


def _adopt(fd: int, domain: str) -> socket.socket:
    return socket.socket(socket.AF_INET6 if domain == "INET6" else socket.AF_INET, socket.SOCK_STREAM, fileno=fd)


def run_uvicorn(sockets: list[socket.socket]) -> None:
    from django.utils.module_loading import import_string

    from comminsight_site import uvicorn_serving

    application = import_string(settings.ASGI_APPLICATION)
    uvicorn_serving.serve(sockets, application, settings.SERVER_BODY_TIMEOUT_S, access_log=settings.SERVER_ACCESS_LOG)


ADOPT = "comminsight-adopt"


def _server_from_string(reactor: object, description: str) -> object:
    """Daphne's endpoint parser, plus ``comminsight-adopt:FD:INET|INET6`` for a socket inherited from the
    supervising ``serve --workers`` (this Twisted has no string form for adopting a listening socket)."""
    from twisted.internet.endpoints import AdoptedStreamServerEndpoint, serverFromString

    prefix, _, rest = description.partition(":")
    if prefix != ADOPT:
        return serverFromString(reactor, description)
    fd, domain = _fd_spec(rest)
    return AdoptedStreamServerEndpoint(reactor, fd, socket.AF_INET6 if domain == "INET6" else socket.AF_INET)


def run_daphne(endpoints: list[str]) -> None:
    import daphne.server
    from daphne.cli import CommandLineInterface

    from comminsight_site import daphne_streaming

    daphne.server.serverFromString = _server_from_string  # type: ignore[assignment]
    server_class = daphne.server.Server
    if settings.SERVER_STREAM_BODIES:
        server_class = daphne_streaming.install(settings.SERVER_BODY_TIMEOUT_S)

    argv = [arg for endpoint in endpoints for arg in ("-e", endpoint)]
    application = settings.ASGI_APPLICATION.rpartition(".")
    cli = CommandLineInterface()
    # Bodies stream to the application as they arrive (comminsight_site.daphne_streaming); request_buffer_size
    # is then only used for a chunked body, which Daphne still buffers whole (and for every body, streaming off).
    cli.server_class = functools.partial(server_class, request_buffer_size=REQUEST_BUFFER_BYTES)
    cli.run([*argv, f"{application[0]}:{application[2]}"])


def _env_workers() -> int:
    value = os.environ.get("COMMINSIGHT_SERVER_WORKERS", "1")
    if not value.strip().isdigit():
        raise CommandError(f"COMMINSIGHT_SERVER_WORKERS must be a whole number, not {value!r}")
    return int(value)


def _fd_spec(value: str) -> tuple[int, str]:
    fd, _, domain = value.partition(":")
    if not fd.isdigit() or domain not in ("INET", "INET6"):
        raise CommandError(f"--inherit-fd takes FD:INET or FD:INET6, not {value!r}")
    return int(fd), domain


def bind(listen: str) -> socket.socket:
    """A listening TCP socket for ``host:port``, inheritable by the worker processes."""
    daphne_endpoint(listen)  # same validation and message as the single-process path
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, int(port)), family=family, backlog=1024)
    except OSError as exc:
        raise CommandError(f"cannot listen on {listen}: {exc}") from exc
    sock.set_inheritable(True)
    return sock


def run_workers(count: int, sockets: list[socket.socket]) -> None:
    """Start ``count`` server workers on ``sockets``; stop them all on SIGTERM/SIGINT or when one dies."""
    specs = [f"{s.fileno()}:{'INET6' if s.family == socket.AF_INET6 else 'INET'}" for s in sockets]
    command = [sys.executable, "-m", "django", "serve", *(arg for spec in specs for arg in ("--inherit-fd", spec))]
    env = lifeline.child_environment(
        {**os.environ, "DJANGO_SETTINGS_MODULE": os.environ.get("DJANGO_SETTINGS_MODULE", "")}
    )
    fds = tuple(s.fileno() for s in sockets)
    children = [subprocess.Popen(command, cwd=settings.BASE_DIR, env=env, pass_fds=fds) for _ in range(count)]
    stopping = threading.Event()

    def stop(signum: int, frame: object) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        while not stopping.is_set() and all(child.poll() is None for child in children):
            time.sleep(0.2)
    finally:
        for child in children:
            if child.poll() is None:
                child.terminate()
        for child in children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        for s in sockets:
            s.close()
    if not stopping.is_set():
        raise CommandError("a server worker exited; all workers were stopped")
