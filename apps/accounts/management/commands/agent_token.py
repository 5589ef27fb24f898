"""``manage.py agent_token create|list|revoke``: agent tokens for operators (secret printed once on create)."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from apps.accounts import services
from apps.accounts.models import AgentToken, User


class Command(BaseCommand):
    help = "Create, list or revoke agent tokens."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        create = sub.add_parser("create", help="create a token; prints the secret once")
        create.add_argument("--owner", required=True, help="user name owning the token (and the uploaded archives)")
        create.add_argument("--name", required=True, help="a name for the token, e.g. node-pool-a")
        listing = sub.add_parser("list", help="list tokens (never their secrets)")
        listing.add_argument("--owner", help="only this user's tokens")
        revoke = sub.add_parser("revoke", help="revoke a token by its prefix or id")
        revoke.add_argument("token", help="the prefix (as in ci_<prefix>_…) or the numeric id")

    def handle(self, *args: object, action: str, **options: object) -> None:
        if action == "create":
            owner = User.objects.filter(username=options["owner"]).first()
            if owner is None:
                raise CommandError(f"no user named {options['owner']!r}")
            try:
                issued = services.agent_token_create(owner=owner, name=str(options["name"]))
            except services.AccountsError as exc:
                raise CommandError(str(exc)) from exc
            self.stderr.write(f"created token {issued.token.name!r} for {owner.username}; it is shown only once:")
            self.stdout.write(issued.secret)
        elif action == "list":
            tokens = AgentToken.objects.select_related("owner").order_by("owner__username", "name")
            if options.get("owner"):
                tokens = tokens.filter(owner__username=options["owner"])
            for t in tokens:
                state = "revoked" if t.revoked_at else "active"
                used = t.last_used_at.isoformat() if t.last_used_at else "never"
                self.stdout.write(f"{t.pk}\tci_{t.prefix}_…\t{t.owner.username}\t{t.name}\t{state}\tlast used {used}")
        else:
            ref = str(options["token"]).removeprefix("ci_").split("_")[0]
            token = AgentToken.objects.filter(prefix=ref).first()
            if token is None and ref.isdigit():
                token = AgentToken.objects.filter(pk=int(ref)).first()
            if token is None:
                raise CommandError(f"no agent token {options['token']!r}")
            if token.revoked_at is None:
                token.revoked_at = timezone.now()
                token.save(update_fields=["revoked_at"])
            self.stdout.write(f"revoked {token.name!r} (ci_{token.prefix}_…) of {token.owner.username}")
