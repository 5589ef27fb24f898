"""The browsable API documentation works without internet access."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.django_db


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
