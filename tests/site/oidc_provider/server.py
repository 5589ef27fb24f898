"""Start the test OpenID Connect provider in its own process (used by the site and browser SSO tests)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[3]
CLIENT_ID, CLIENT_SECRET = "comminsight", "s3cret-of-the-test-client"
# People at the provider: (user name, e-mail, password).
PEOPLE = [("dana", "dana@example.org", "dana-password"), ("root", "root@example.org", "root-password")]

SET_UP = f"""
from django.contrib.auth.models import User
from django.core.management import call_command
from oidc_provider.models import Client, ResponseType
call_command("creatersakey")
for name, email, password in {PEOPLE!r}:
    User.objects.create_user(name, email, password)
client = Client.objects.create(
    name="CommInsight", client_id={CLIENT_ID!r}, client_secret={CLIENT_SECRET!r}, client_type="confidential",
    jwt_alg="RS256", require_consent=False, reuse_consent=True,
)
client.scope = ["openid", "email", "profile"]
client.save()
client.response_types.add(ResponseType.objects.get(value="code"))
"""

ALLOW_REDIRECT = """
from oidc_provider.models import Client
client = Client.objects.get(client_id={client_id!r})
client.redirect_uris = [*client.redirect_uris, {uri!r}]
client.save()
"""


@dataclass(frozen=True)
class Provider:
    url: str
    env: dict[str, str]

    def manage(self, *args: str) -> None:
        done = subprocess.run(
            [sys.executable, "-m", "django", *args], cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr

    def allow_redirect(self, uri: str) -> None:
        """Register one more redirect URI of the CommInsight client (the provider checks them exactly)."""
        self.manage("shell", "-c", ALLOW_REDIRECT.format(client_id=CLIENT_ID, uri=uri))

    def site_settings(self, settings) -> None:
        """Point the site's single sign-on at this provider."""
        settings.SSO_ENABLED = True
        settings.SSO_PROVIDER_NAME = "Example SSO"
        settings.OIDC_RP_CLIENT_ID = CLIENT_ID
        settings.OIDC_RP_CLIENT_SECRET = CLIENT_SECRET
        settings.OIDC_OP_AUTHORIZATION_ENDPOINT = f"{self.url}/openid/authorize"
        settings.OIDC_OP_TOKEN_ENDPOINT = f"{self.url}/openid/token"
        settings.OIDC_OP_USER_ENDPOINT = f"{self.url}/openid/userinfo"
        settings.OIDC_OP_JWKS_ENDPOINT = f"{self.url}/openid/jwks"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def running_provider(directory: Path) -> Iterator[Provider]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMMINSIGHT_", "DJANGO_"))}
    env.update(
        DJANGO_SETTINGS_MODULE="tests.site.oidc_provider.settings",
        OIDC_PROVIDER_URL=url,
        OIDC_PROVIDER_DB=str(directory / "provider.sqlite3"),
    )
    provider = Provider(url, env)
    provider.manage("migrate", "-v0")
    provider.manage("shell", "-c", SET_UP)
    server = subprocess.Popen(
        [sys.executable, "-m", "django", "runserver", "--noreload", f"127.0.0.1:{port}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/openid/jwks", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert server.poll() is None, "the OpenID Connect provider exited"
            assert time.monotonic() < deadline, "the OpenID Connect provider did not start"
            time.sleep(0.2)
        yield provider
    finally:
        server.terminate()
        server.wait(timeout=10)
