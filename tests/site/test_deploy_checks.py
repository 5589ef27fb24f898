"""The operator-facing checks CI runs: Django's deployment check and the OpenAPI schema validation."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def manage(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def production_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMMINSIGHT_", "DJANGO_"))}
    env.update(
        COMMINSIGHT_ENV="production",
        SECRET_KEY="x" * 20 + "a-long-random-production-secret-key-0123456789",
        COMMINSIGHT_SERVER_PUBLIC_URL="https://comminsight.example.org",
        COMMINSIGHT_SERVER_DATA_DIR=str(tmp_path),
        DJANGO_SETTINGS_MODULE="comminsight_site.settings",
    )
    env.update(extra)
    return env


def test_production_settings_pass_the_deployment_check(tmp_path):
    result = manage("check", "--deploy", "--fail-level", "WARNING", env=production_env(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_production_without_a_secret_key_fails_at_start(tmp_path):
    env = production_env(tmp_path)
    del env["SECRET_KEY"]
    result = manage("check", env=env)
    assert result.returncode != 0
    assert "SECRET_KEY" in result.stderr


def test_unknown_environment_name_fails_at_start(tmp_path):
    result = manage("check", env=production_env(tmp_path, COMMINSIGHT_ENV="staging"))
    assert result.returncode != 0
    assert "COMMINSIGHT_ENV" in result.stderr


@pytest.mark.parametrize("environment", ["development", "production"])
def test_openapi_schema_validates_without_warnings(tmp_path, environment):
    env = production_env(tmp_path, COMMINSIGHT_ENV=environment)
    result = manage("spectacular", "--validate", "--fail-on-warn", "--file", str(tmp_path / "schema.yaml"), env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "/api/v1/workloads/" in (tmp_path / "schema.yaml").read_text()


def _debug_setting(tmp_path: Path, **extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMMINSIGHT_", "DJANGO_")) and k != "DEBUG"}
    env.update(COMMINSIGHT_SERVER_DATA_DIR=str(tmp_path), **extra)
    result = manage("shell", "-c", "from django.conf import settings; print('DEBUG', settings.DEBUG)", env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout.split("DEBUG", 1)[1].strip()


def test_make_run_environment_serves_without_debug_pages(tmp_path):
    # `make run` sets nothing: Django's debug 404 (every URL pattern) must not be what a stranger sees.
    assert _debug_setting(tmp_path) == "False"


def test_debug_is_on_only_when_development_is_asked_for(tmp_path):
    assert _debug_setting(tmp_path, COMMINSIGHT_ENV="development") == "True"
