"""An analysis job through a real Celery worker (in this process, against Redis; not eager mode). Marked slow."""

from __future__ import annotations

import json
import time

import pytest
from django.test import Client
from django.urls import reverse

from tests.site.analysis_tables import hung_table, write_store

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_a_real_worker_runs_the_hang_analysis_and_the_api_shows_the_verdict(
    real_celery_worker,
    personas,
    data_dir,
):
    write_store(data_dir, personas.workload.pk, hung_table(ranks=8, stuck_rank=5))
    client = Client()
    client.force_login(personas.bob)
    response = client.post(
        reverse("api-analyses", kwargs={"workload_id": personas.workload.pk}),
        data=json.dumps({"kind": "hang"}),
        content_type="application/json",
    )
    assert response.status_code == 201
    url = reverse("api-analysis-detail", kwargs={"workload_id": personas.workload.pk, "job_id": response.json()["id"]})
    deadline = time.monotonic() + 60
    job = response.json()
    while job["state"] not in ("done", "failed") and time.monotonic() < deadline:
        time.sleep(0.2)
        job = client.get(url).json()
    assert job["state"] == "done", job["error"]
    assert job["result"]["root_cause_ranks"] == [5]
