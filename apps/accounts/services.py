"""State changes for accounts: bootstrap (first-run initialisation), roles, users, agent tokens.

The bootstrap token exists in exactly one place in clear: ``<data dir>/bootstrap-token`` (mode 0600). The
database keeps its sha256. Initialisation locks the single ``BootstrapToken`` row, checks the token in
constant time, creates root (a partial unique index allows one root only), deletes the row and — after the
transaction commits — unlinks the file. A replay finds no row; a concurrent second attempt waits on the
lock, then finds no row; if the lock is not enforced (SQLite), the unique index refuses the second root.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.db import IntegrityError, OperationalError, transaction
from django.utils import timezone

from comminsight_site import rows

from .models import AgentToken, BootstrapFailure, BootstrapToken, Role, User
from .passwords import password_byte_length_problem

logger = logging.getLogger(__name__)


class BootstrapError(Exception):
    """Initialisation refused; the message is safe to show to the person at the page."""


class BootstrapThrottled(BootstrapError):
    """Too many wrong tokens from one address recently."""


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def bootstrap_token_path() -> Path:
    return Path(settings.BOOTSTRAP_TOKEN_PATH)


def root_exists() -> bool:
    return User.objects.filter(role=Role.ROOT).exists()


def _write_private_file(path: Path, content: str) -> None:
    """Write ``content`` to ``path`` with mode 0600 from the first byte, replacing it atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask cannot widen it, but be explicit
        os.write(fd, content.encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def bootstrap_issue() -> Path:
    """Create a fresh token (replacing any earlier one) while no root exists; return the file's path."""
    if root_exists():
        raise BootstrapError("The site is already initialised; there is no bootstrap token to issue.")
    token = secrets.token_urlsafe(32)
    path = bootstrap_token_path()
    with transaction.atomic():
        BootstrapToken.objects.update_or_create(id=1, defaults={"token_sha256": _sha256(token)})
        _write_private_file(path, token + "\n")
    logger.info("bootstrap token written to %s", path)
    return path


def bootstrap_ensure() -> Path | None:
    """At start: while no root exists make sure a usable token file exists; return its path (None if initialised).

    A token file whose hash matches the database is kept, so restarts do not invalidate a token an
    operator already copied.
    """
    if root_exists():
        return None
    path = bootstrap_token_path()
    row = BootstrapToken.objects.filter(id=1).first()
    if row is not None and path.is_file():
        try:
            current = path.read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError):
            current = ""
        if current and hmac.compare_digest(_sha256(current), row.token_sha256):
            return path
    return bootstrap_issue()


@dataclass(frozen=True)
class BootstrapStatus:
    initialised: bool
    token_path: Path
    token_file_exists: bool
    token_issued_at: object


def bootstrap_status() -> BootstrapStatus:
    row = BootstrapToken.objects.filter(id=1).first()
    path = bootstrap_token_path()
    return BootstrapStatus(root_exists(), path, path.exists(), row.created_at if row else None)


def _throttled(address: str) -> bool:
    since = timezone.now() - timedelta(seconds=settings.BOOTSTRAP_FAILURE_WINDOW_S)
    return BootstrapFailure.objects.filter(address=address, at__gte=since).count() >= settings.BOOTSTRAP_FAILURE_LIMIT


def bootstrap_initialise(*, token: str, username: str, password: str, address: str = "unknown") -> User:
    """Create root with ``password`` if ``token`` is the current bootstrap token. Single use under concurrency."""
    if _throttled(address):
        raise BootstrapThrottled("Too many wrong tokens from your address; wait 15 minutes and try again.")
    problem = password_byte_length_problem(password)
    if problem:
        raise BootstrapError(problem)
    username = username.strip()
    if not username or len(username) > 150:
        raise BootstrapError("Choose a user name of 1 to 150 characters.")
    try:
        with transaction.atomic():
            row = BootstrapToken.objects.select_for_update().filter(id=1).first()
            if row is None or root_exists():
                raise BootstrapError("This site is already initialised; the bootstrap token was used and is void.")
            if not hmac.compare_digest(_sha256(token.strip()), row.token_sha256):
                wrong = True
            else:
                wrong = False
                root = User(username=username, role=Role.ROOT, is_staff=False, is_superuser=False)
                root.set_password(password)
                root.save()
                row.delete()
    except IntegrityError as exc:
        # Another initialisation committed root first.
        raise BootstrapError("This site is already initialised; the bootstrap token was used and is void.") from exc
    except OperationalError as exc:
        # SQLite (embedded mode) locks the table instead of waiting on the row lock.
        raise BootstrapError("Another initialisation is in progress; reload the page and try again.") from exc
    if wrong:
        # Recorded outside the transaction above so the failure counts even though nothing else changed.
        BootstrapFailure.objects.create(address=address)
        raise BootstrapError("That is not the current bootstrap token. Copy it again from the file the server named.")
    # The row is gone (committed): the token is void whatever happens to the file, so remove it now.
    _remove_token_file()
    logger.info("site initialised; root account %r created", username)
    return root


def _remove_token_file() -> None:
    with contextlib.suppress(FileNotFoundError):
        bootstrap_token_path().unlink()


# --- roles and users ------------------------------------------------------------------------------------------


class AccountsError(Exception):
    """A refused account change; the message is safe to show."""


def user_set_admin(*, actor: User, user: User, admin: bool) -> User:
    """Root grants (``admin=True``) or revokes the administrator role."""
    if not actor.is_root:
        raise AccountsError("Only root grants or revokes administrators.")
    if user.is_root:
        raise AccountsError("Root's role cannot change.")
    user.role = Role.ADMIN if admin else Role.USER
    user.save(update_fields=["role"])
    logger.info("%s %s administrator role of %s", actor.username, "granted" if admin else "revoked", user.username)
    return user


def user_create(*, actor: User, username: str, password: str, email: str = "") -> User:
    """Administrators create regular users (who start without any workload)."""
    from django.contrib.auth.password_validation import validate_password
    from django.core.exceptions import ValidationError

    if not actor.is_site_admin:
        raise AccountsError("Only administrators create users.")
    username = username.strip()
    if not username:
        raise AccountsError("A user name is required.")
    if User.objects.filter(username=username).exists():
        raise AccountsError(f"A user named {username!r} already exists.")
    user = User(username=username, email=email, role=Role.USER)
    try:
        validate_password(password, user)
    except ValidationError as exc:
        raise AccountsError(" ".join(exc.messages)) from exc
    user.set_password(password)
    user.save()
    return user


def external_user_sign_in(*, identity: str, username_hint: str, email: str = "") -> User:
    """The account of an identity from the single sign-on provider, created on first sign-in.

    Found by ``identity`` only (never by name or e-mail, so a provider account called "root" or carrying an
    administrator's address is a different person here); created as a regular user with no usable password —
    external identities never become administrators automatically (root promotes them like anyone).
    """
    user = User.objects.filter(external_identity=identity).first()
    if user is not None:
        return user
    base = re.sub(r"[^\w.@+-]", "-", username_hint.strip())[:140] or "sso-user"
    username, suffix = base, 1
    while User.objects.filter(username=username).exists():
        suffix += 1
        username = f"{base}-{suffix}"
    user = User(username=username, email=email[:254], role=Role.USER, external_identity=identity)
    user.set_unusable_password()
    try:
        with transaction.atomic():
            user.save()
    except IntegrityError:  # the same identity's concurrent first sign-in (or a name taken meanwhile): retry
        return external_user_sign_in(identity=identity, username_hint=username_hint, email=email)
    logger.info("single sign-on created user %s for %s", username, identity)
    return user


# --- agent tokens ----------------------------------------------------------------------------------------------

AGENT_TOKEN_PREFIX = "ci_"  # noqa: S105 (a public marker, not a secret)


@dataclass(frozen=True)
class IssuedAgentToken:
    token: AgentToken
    secret: str  # the whole ``ci_<prefix>_<secret>`` string; shown once, never stored


def agent_token_create(*, owner: User, name: str) -> IssuedAgentToken:
    name = name.strip()
    if not name or len(name) > 100:
        raise AccountsError("Give the token a name of 1 to 100 characters (for example the node pool).")
    if AgentToken.objects.filter(owner=owner, name=name).exists():
        raise AccountsError(f"{owner.username} already has a token named {name!r}.")
    prefix = secrets.token_hex(4)
    secret = secrets.token_urlsafe(32)
    token = AgentToken.objects.create(owner=owner, name=name, prefix=prefix, secret_sha256=_sha256(secret))
    return IssuedAgentToken(token, f"{AGENT_TOKEN_PREFIX}{prefix}_{secret}")


def agent_token_authenticate(presented: str) -> AgentToken | None:
    """The active token ``presented`` stands for, or None. Constant-time on the secret.

    The token's row and its owner's are read in one statement on a bare cursor (``comminsight_site.rows``: an ORM
    query cost several times more CPU than the statement) and kept by this process for
    ``AGENT_TOKEN_CACHE_S`` seconds (``_token_rows``): every agent request presents its token, and that statement
    was a fifth of a heartbeat's database work. So a token revoked or an owner deactivated by this process is
    refused from the next request on (saving either clears the kept rows), by another process (another server
    worker, a management command) within ``AGENT_TOKEN_CACHE_S``. The secret is checked on every request."""
    if not presented.startswith(AGENT_TOKEN_PREFIX):
        return None
    prefix, _, secret = presented[len(AGENT_TOKEN_PREFIX) :].partition("_")
    if not prefix or not secret:
        return None
    token = _agent_token_with_owner(prefix)
    if token is None or not hmac.compare_digest(_sha256(secret), token.secret_sha256) or not token.is_active:
        return None
    now = timezone.now()
    # Avoid a write per request: record use at most once a minute.
    if token.last_used_at is None or now - token.last_used_at > timedelta(minutes=1):
        AgentToken.objects.filter(pk=token.pk).update(last_used_at=now)
        token.last_used_at = now
        _token_rows.forget(prefix)  # the kept row has the old time
    return token


class TokenRows:
    """The rows (token and owner, as read) of agent tokens found recently, by prefix, for ``ttl_s()`` seconds.

    Rows, not model instances, are kept: each request gets instances of its own. Only prefixes that exist are
    kept (at most one entry per token in the database, whatever clients present). A row read before a
    ``clear`` is not kept after it (``generation``): a request that read a token just before its revocation
    committed cannot keep the old row. ``clock`` is injectable for tests."""

    def __init__(self, ttl_s: Callable[[], float], clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.clock = ttl_s, clock
        self._rows: dict[str, tuple[float, tuple]] = {}
        self.generation = 0

    def get(self, prefix: str) -> tuple | None:
        kept = self._rows.get(prefix)
        if kept is None:
            return None
        if self.clock() >= kept[0]:
            self._rows.pop(prefix, None)
            return None
        return kept[1]

    def keep(self, prefix: str, row: tuple, generation: int) -> None:
        """Keep ``row``, read after ``generation`` was taken, unless a ``clear`` came since."""
        ttl = self.ttl_s()
        if ttl > 0 and generation == self.generation:
            self._rows[prefix] = (self.clock() + ttl, row)

    def forget(self, prefix: str) -> None:
        self._rows.pop(prefix, None)

    def clear(self) -> None:
        self.generation += 1
        self._rows.clear()


_token_rows = TokenRows(lambda: settings.AGENT_TOKEN_CACHE_S)


def agent_token_rows_clear(**kwargs: object) -> None:
    """Forget every kept token row, now and once the change commits (connected to saves and deletes of tokens and
    users: a revocation, a deactivation or a role change made by this process counts from the next request on)."""
    _token_rows.clear()
    transaction.on_commit(_token_rows.clear, using=kwargs.get("using"))  # type: ignore[arg-type]


def _agent_token_with_owner(prefix: str) -> AgentToken | None:
    """``AgentToken.objects.select_related("owner").get(prefix=prefix)`` as one bare statement (None if absent),
    or from the rows kept for ``AGENT_TOKEN_CACHE_S``."""
    found = _token_rows.get(prefix)
    if found is None:
        generation = _token_rows.generation
        sql = (
            f"SELECT {rows.columns(AgentToken, 't')}, {rows.columns(User, 'u')} "  # noqa: S608 (names from the models)
            f"FROM {rows.table(AgentToken)} t JOIN {rows.table(User)} u "
            f"ON u.{rows.column(User, 'id')} = t.{rows.column(AgentToken, 'owner')} "
            f"WHERE t.{rows.column(AgentToken, 'prefix')} = %s"
        )
        with rows.cursor() as cursor:
            cursor.execute(sql, [prefix])
            found = cursor.fetchone()
        if found is None:
            return None
        _token_rows.keep(prefix, tuple(found), generation)
    split = len(AgentToken._meta.concrete_fields)
    token = rows.row(AgentToken, found[:split])
    token.owner = rows.row(User, found[split:])
    return token


def agent_token_revoke(*, actor: User, token: AgentToken) -> AgentToken:
    if token.owner_id != actor.pk and not actor.is_site_admin:
        raise AccountsError("You may revoke only your own tokens.")
    if token.revoked_at is None:
        token.revoked_at = timezone.now()
        token.save(update_fields=["revoked_at"])
    return token
