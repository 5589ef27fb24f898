"""``manage.py bootstrap status|reissue``: inspect or replace the one-time initialisation token.

Prints the token file's path, never the token.
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.accounts import services


class Command(BaseCommand):
    help = "Show the first-run bootstrap state, or issue a new token (only while no root exists)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("action", choices=["status", "reissue"])

    def handle(self, *args: object, action: str, **options: object) -> None:
        if action == "status":
            state = services.bootstrap_status()
            if state.initialised:
                self.stdout.write("initialised: a root account exists; no bootstrap token is valid")
            elif state.token_file_exists:
                self.stdout.write(f"waiting for initialisation; token file: {state.token_path}")
            else:
                self.stdout.write(
                    "waiting for initialisation; no token file (run `manage.py bootstrap reissue` or start the site)"
                )
            return
        try:
            path = services.bootstrap_issue()
        except services.BootstrapError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"new bootstrap token written to {path} (mode 0600); earlier tokens are void")
