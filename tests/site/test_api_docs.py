"""The browsable API documentation works without internet access."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[2]


def test_the_api_docs_page_loads_swagger_ui_from_the_site_itself(client):
    page = client.get("/api/docs/").content.decode()
    assets = re.findall(r'(?:src|href)="([^"]+)"', page)
    swagger = [asset for asset in assets if "swagger-ui" in asset]
    assert swagger, "the page names no Swagger UI asset"
    assert all(asset.startswith("/static/") for asset in swagger), swagger


def test_the_openapi_schema_is_served(client):
    response = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    assert b"/api/v1/ingest/uploads/" in response.content


def test_the_served_schema_is_the_committed_one(client):
    # docs/api/openapi.yaml is the API's contract for clients; `make openapi` rewrites it after an API change.
    committed = yaml.safe_load((ROOT / "docs/api/openapi.yaml").read_text())
    served = yaml.safe_load(client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi").content)
    assert served == committed, "the API changed: run `make openapi` and commit docs/api/openapi.yaml"
