"""Schemathesis against the served schema (/api/schema/): generated requests for every operation, in this
process through the WSGI handler, signed in as alice (session + CSRF) and with her agent token. Fails on any
5xx and on any answer the schema does not describe (status, content type, body). Bounded: a few examples
per operation, about two minutes in all."""

from __future__ import annotations

import pytest
import schemathesis
from django.core import signals
from django.core.handlers.wsgi import WSGIHandler
from django.db import close_old_connections
from django.middleware.csrf import _get_new_csrf_string
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

CSRF = _get_new_csrf_string()
# Upload chunks are raw bytes under the protocol's own media type.
schemathesis.serializer.alias("application/offset+octet-stream", "application/octet-stream")


@pytest.fixture
def api_schema(personas, client):
    # As Django's test client does: requests in this process must not close the test's database connection.
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    schema = schemathesis.openapi.from_wsgi("/api/schema/", WSGIHandler())
    # Credentials are the test's (alice's session and token), not generated data.
    schema.config.generation.update(with_security_parameters=False)
    yield schema
    signals.request_started.connect(close_old_connections)
    signals.request_finished.connect(close_old_connections)


@pytest.fixture
def credentials(personas, client) -> dict[str, str]:
    client.force_login(personas.alice)
    return {
        "cookies": {"sessionid": client.cookies["sessionid"].value, "csrftoken": CSRF},
        "headers": {"X-CSRFToken": CSRF, "Authorization": f"Bearer {personas.agent_secret}"},
    }


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_every_operation_answers_as_its_schema_says(case, credentials):
    # Not checked: that every schema-valid request is accepted. Some are refused by rules a schema cannot state
    # (an archive's bytes must match their sha256, a communicator's ranks must name ranks): 4xx, documented.
    case.call_and_validate(**credentials, excluded_checks=[positive_data_acceptance])
