"""Monitoring: heartbeats and archives become time series; dashboards downsample them; NIC counters beside analyses."""

from __future__ import annotations

import logging
import statistics
import sys
from datetime import timedelta
from pathlib import Path

import polars as pl
import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator
from django.db import connection, transaction
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from apps.analysis.models import AnalysisJob, JobState
from apps.monitoring import selectors, services
from apps.monitoring.models import Point, Rollup, Series
from apps.monitoring.services import Sample
from apps.workloads.models import Node, Rank, Workload, WorkloadStatus
from comminsight_site.asgi import application

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "semantic"))
import synthetic

NS = 1_000_000_000


def now_ns() -> int:
    return int(timezone.now().timestamp() * NS)


def heartbeat(node: str = "n1", workload: str = "job-mon", **extra) -> dict:
    end = now_ns() - NS
    body = {
        "workload_id": workload,
        "node": node,
        "ranks": [0, 1],
        "communicators": [{"comm_hash": "0x00000000000000aa", "nranks": 2, "last_completed_seq": 3, "inflight": 2}],
        "steps": [
            {"rank": 0, "step": 41, "start_ns": end - 1_400_000_000, "end_ns": end, "duration_s": 1.4, "comm_s": 0.3},
            {"rank": 1, "step": 41, "start_ns": end - 1_600_000_000, "end_ns": end, "duration_s": 1.6, "comm_s": 0.3},
        ],
        "devices": [{"gpu": 0, "util_pct": 97.0, "mem_used_bytes": 40e9, "power_w": 612.5}],
        "nics": [
            {
                "device": "mlx5_0",
                "port": 1,
                "rx_bytes_per_s": 2e10,
                "tx_bytes_per_s": 1.9e10,
                "errors_per_s": 0.0,
                "discards_per_s": 0.0,
            }
        ],
        "agent": {"records_per_s": 12000.0, "dropped_records": 0, "inflight_ops": 2, "cpu_pct": 3.5},
    }
    body.update(extra)
    return body


def post(agent: Client, body: dict):
    return agent.post(reverse("api-ingest-live"), body, content_type="application/json")


def charts_of(client: Client, workload: Workload, **params) -> dict[str, dict]:
    response = client.get(reverse("api-workload-monitoring", args=[workload.pk]), params)
    assert response.status_code == 200, response.content
    return {c["metric"]: c for c in response.json()["charts"]}


def test_a_heartbeat_shows_step_times_gpu_and_nic_counters_on_the_dashboard(agent, personas):
    assert post(agent, heartbeat()).status_code == 202
    workload = Workload.objects.get(external_id="job-mon")
    client = Client()
    client.force_login(personas.alice)
    charts = charts_of(client, workload, range="15m")
    steps = charts["step_duration_s"]["data"]
    assert steps["mode"] == "lines"
    assert {k: [v for _, v in pts] for k, pts in steps["lines"].items()} == {"0": [1.4], "1": [1.6]}
    assert [v for _, v in charts["gpu_util_pct"]["data"]["lines"]["n1/gpu0"]] == [97.0]
    assert [v for _, v in charts["nic_rx_bytes_per_s"]["data"]["lines"]["n1/mlx5_0:1"]] == [20.0]  # GB/s
    assert [v for _, v in charts["inflight_ops"]["data"]["lines"]["n1"]] == [2.0]
    assert charts["step_duration_s"]["option"]["series"][0]["name"] == "0"


def test_the_same_heartbeat_twice_adds_no_points(agent):
    body = heartbeat()
    post(agent, body)
    stored = Point.objects.count()
    post(agent, body)
    assert Point.objects.count() == stored
    assert sum(Rollup.objects.filter(width_s=60).values_list("n", flat=True)) == stored


def _points_of(workload: Workload) -> list[tuple[str, str, int, float]]:
    return sorted(
        Point.objects.filter(series__workload=workload).values_list("series__metric", "series__key", "t_ms", "value")
    )


def test_a_heartbeat_with_nothing_new_makes_no_statement_and_the_points_stay(
    personas, django_capture_on_commit_callbacks
):
    workload = Workload.objects.create(owner=personas.alice, external_id="job-quiet", name="job-quiet")
    at, body = timezone.now(), heartbeat(workload="job-quiet")
    with django_capture_on_commit_callbacks(execute=True):
        assert services.monitoring_record_heartbeat(workload=workload, node="n1", heartbeat=body, at=at) > 0
    stored = _points_of(workload)
    with CaptureQueriesContext(connection) as queries, django_capture_on_commit_callbacks(execute=True):
        assert services.monitoring_record_heartbeat(workload=workload, node="n1", heartbeat=body, at=at) == 0
    assert [q["sql"] for q in queries.captured_queries] == []
    assert _points_of(workload) == stored
    # The next 5-second slot is a new point of every node-level series.
    with django_capture_on_commit_callbacks(execute=True):
        later = at + timedelta(seconds=5)
        assert services.monitoring_record_heartbeat(workload=workload, node="n1", heartbeat=body, at=later) > 0
    assert len(_points_of(workload)) > len(stored)


def test_points_of_old_slots_are_forgotten_even_after_an_agent_placed_one_an_hour_ahead():
    # Agents' clocks may run up to MAX_FUTURE_S ahead; a step placed there must not hold back forgetting the
    # rest (each slot brings new points: the process's memory would grow for as long as it stayed ahead).
    now = [1_000_000.0]
    stored = services.StoredPoints(keep_ms=10_000, clock=lambda: now[0])
    ahead = Sample("step_duration_s", "0", "n1", int(now[0] * 1000) + services.MAX_FUTURE_S * 1000, 1.0)
    slot = Sample("lagging_ranks", "", "", int(now[0] * 1000), 0.0)
    stored.add(7, [ahead])
    stored.add(7, [slot])
    assert stored.new(7, [slot]) == []
    for _ in range(3):  # three 5-second slots later, each with its own point
        now[0] += 5
        stored.add(7, [Sample("lagging_ranks", "", "", int(now[0] * 1000), 0.0)])
    assert stored.new(7, [slot]) == [slot]  # forgotten: sent again (the database keeps it once)


def test_the_points_of_a_heartbeat_rolled_back_are_stored_by_the_next(personas, django_capture_on_commit_callbacks):
    workload = Workload.objects.create(owner=personas.alice, external_id="job-undone", name="job-undone")
    at, body = timezone.now(), heartbeat(workload="job-undone")

    def failing_request() -> None:
        with transaction.atomic():
            services.monitoring_record_heartbeat(workload=workload, node="n1", heartbeat=body, at=at)
            raise RuntimeError("the request failed after its points were written")

    with django_capture_on_commit_callbacks(execute=True), pytest.raises(RuntimeError):
        failing_request()
    assert _points_of(workload) == []
    with django_capture_on_commit_callbacks(execute=True):
        assert services.monitoring_record_heartbeat(workload=workload, node="n1", heartbeat=body, at=at) > 0
    assert _points_of(workload) != []


def test_bad_values_are_skipped_with_a_log_line_and_the_heartbeat_still_counts(agent, caplog):
    body = heartbeat(
        devices=[{"gpu": 0, "util_pct": "busy"}, {"gpu": 1, "util_pct": 55.0}],
        nics=[{"device": "mlx5_0", "port": 1, "rx_bytes_per_s": -5.0}, {"device": "mlx5_1"}],
        steps=[{"rank": 0, "duration_s": 1.2}],
        agent={"dropped_records": None, "cpu_pct": "high"},
    )
    with caplog.at_level(logging.WARNING, logger="apps.monitoring.services"):
        response = post(agent, body)
    assert response.status_code == 202
    assert Workload.objects.get(external_id="job-mon").status == WorkloadStatus.RUNNING
    log = caplog.text
    for problem in (
        "devices[0].util_pct: not a number",
        "nics[0].rx_bytes_per_s: negative",
        "nics[1].port",
        "steps[0].end_ns",
        "agent.cpu_pct: not a number",
    ):
        assert problem in log
    kept = set(Series.objects.values_list("metric", "key"))
    assert ("gpu_util_pct", "n1/gpu1") in kept
    assert ("gpu_util_pct", "n1/gpu0") not in kept
    assert ("nic_rx_bytes_per_s", "n1/mlx5_0:1") not in kept


def test_a_heartbeat_of_the_wrong_shape_is_refused_and_changes_nothing(agent):
    response = post(agent, heartbeat(devices="many"))
    assert response.status_code == 400
    assert "devices" in response.json()
    assert not Workload.objects.filter(external_id="job-mon").exists()


def test_heartbeats_without_the_new_keys_are_accepted(agent):
    body = {"workload_id": "job-mon", "node": "n1", "communicators": []}
    assert post(agent, body).status_code == 202
    assert not Point.objects.filter(series__metric="step_duration_s").exists()


def test_people_who_cannot_see_the_workload_get_404_for_its_dashboard_and_socket(personas):
    carol = Client()
    carol.force_login(personas.carol)
    assert carol.get(reverse("monitoring:workload", args=[personas.workload.pk])).status_code == 404
    assert carol.get(reverse("api-workload-monitoring", args=[personas.workload.pk])).status_code == 404

    def headers(user):
        client = Client()
        client.force_login(user)
        return [
            (b"origin", b"http://127.0.0.1"),
            (b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode()),
        ]

    async def connect(cookie):
        communicator = WebsocketCommunicator(
            application, f"/ws/monitoring/workloads/{personas.workload.pk}/", headers=cookie
        )
        connected, code = await communicator.connect()
        if connected:
            await communicator.disconnect()
        return connected, code

    assert async_to_sync(connect)(headers(personas.carol)) == (False, 4404)
    assert async_to_sync(connect)(headers(personas.bob))[0] is True


@pytest.mark.django_db(transaction=True)
def test_an_open_dashboard_socket_hears_about_new_points(personas):
    from apps.accounts.services import agent_token_authenticate
    from apps.workloads.live import live_record_heartbeat

    token = agent_token_authenticate(personas.agent_secret)
    workload = Workload.objects.create(owner=personas.alice, external_id="job-mon", name="job-mon")
    client = Client()
    client.force_login(personas.alice)
    headers = [(b"origin", b"http://127.0.0.1"), (b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode())]

    async def scenario():
        from channels.db import database_sync_to_async

        communicator = WebsocketCommunicator(application, f"/ws/monitoring/workloads/{workload.pk}/", headers=headers)
        connected, _ = await communicator.connect()
        assert connected
        await database_sync_to_async(lambda: live_record_heartbeat(token=token, heartbeat=heartbeat()))()
        message = await communicator.receive_json_from(timeout=30)  # a busy 2-core machine
        await communicator.disconnect()
        return message

    message = async_to_sync(scenario)()
    assert message["type"] == "points"
    assert "step_duration_s" in message["metrics"]


def test_many_ranks_are_drawn_as_min_median_max_across_ranks(personas):
    workload = personas.workload
    t0 = (now_ns() // NS - 600) * 1000
    values = {rank: 1.0 + rank * 0.01 for rank in range(40)}
    services.points_record(
        workload.pk, [Sample("step_duration_s", str(r), "n1", t0 + 1000, v) for r, v in values.items()]
    )
    span = selectors.time_range({"range": "1h"})
    (chart,) = selectors.dashboard(workload, span, ["step_duration_s"])
    assert chart["data"]["mode"] == "band"
    ((_, low, median, high, ranks),) = chart["data"]["band"]
    assert (low, high, ranks) == (1.0, pytest.approx(1.39), 40)
    assert median == pytest.approx(statistics.median(values.values()), rel=1e-3)
    assert [s["name"] for s in chart["option"]["series"]] == ["max", "median", "min"]


def test_a_day_is_read_from_rollups_with_the_same_means_as_the_raw_points(personas):
    workload = personas.workload
    end_s = now_ns() // NS
    samples = [
        Sample("gpu_util_pct", f"n1/gpu{g}", "n1", (end_s - 86400 + i * 5) * 1000, float((i * 7 + g) % 100))
        for g in range(3)
        for i in range(0, 86400 // 5, 3)
    ]
    services.points_record(workload.pk, samples)
    span = selectors.time_range({"range": "24h"})
    keys = dict(Series.objects.filter(workload=workload).values_list("id", "key"))
    source, bucket = selectors.resolution(span.span_s, len(keys))
    assert source > 0  # a day is not read point by point
    from_rollups = selectors.chart_data(workload, "gpu_util_pct", span, keys)["lines"]
    raw = selectors._lines(selectors._per_series_buckets(workload.pk, "gpu_util_pct", span, 0, bucket), keys)
    assert set(from_rollups) == set(raw)
    for key, points in from_rollups.items():
        assert [t for t, _ in points] == [t for t, _ in raw[key]]
        assert [v for _, v in points] == pytest.approx([v for _, v in raw[key]], rel=1e-3)


def test_points_older_than_the_retention_period_are_purged(personas, settings):
    settings.MONITORING_RETENTION_DAYS = 1
    workload = personas.workload
    now_ms = now_ns() // 1_000_000
    old, recent = now_ms - 3 * 86_400_000, now_ms - 60_000
    services.points_record(
        workload.pk,
        [
            Sample("gpu_util_pct", "n1/gpu0", "n1", old, 10.0),
            Sample("gpu_util_pct", "n1/gpu0", "n1", recent, 20.0),
            Sample("gpu_util_pct", "n9/gpu0", "n9", old, 30.0),
        ],
    )
    counts = services.points_purge()
    assert counts["points"] == 2
    assert list(Point.objects.values_list("t_ms", flat=True)) == [recent]
    assert not Rollup.objects.filter(bucket_ms__lt=now_ms - 86_400_000 - 600_000).exists()
    assert list(Series.objects.values_list("key", flat=True)) == ["n1/gpu0"]


def _operations_now(**kwargs) -> pl.DataFrame:
    frame = pl.from_arrow(synthetic.table("ddp", **kwargs))
    shift = now_ns() - 120 * NS
    return frame.with_columns(*(pl.col(c) + shift for c in ("enqueue_ns", "start_ns", "end_ns")))


def test_archive_summaries_give_step_times_per_rank_and_bandwidth_per_communicator():
    operations = _operations_now(ranks=4, steps=8)
    first, last = operations["start_ns"].min(), operations["end_ns"].max()
    samples = services.archive_samples(operations, first, last, "n1")
    steps = [s for s in samples if s.metric == "step_duration_s"]
    assert {s.key for s in steps} == {"0", "1", "2", "3"}
    assert 4 * 4 <= len(steps) <= 4 * 6  # whole steps only: the first and last of each rank are left out
    assert all(0 < s.value < 1 for s in steps)
    busbw = [s for s in samples if s.metric == "coll_busbw_gbs"]
    assert busbw
    assert all(s.value > 0 for s in busbw)
    algbw = {s.key: s.value for s in samples if s.metric == "coll_algbw_gbs"}
    assert all(b.value >= algbw[b.key] for b in busbw)  # bus factor >= 1 for all-reduce


def test_an_ingested_archive_gets_communicator_bandwidth_series(personas, tmp_path, django_capture_on_commit_callbacks):
    from apps.workloads.ingest import archive_ingest
    from apps.workloads.models import ArchiveState
    from apps.workloads.uploads import archive_register
    from tests.site.archives import sha256_of, valid_archive

    path = valid_archive(tmp_path, ranks=(0, 1))
    archive, _ = archive_register(
        source_path=path, sha256=sha256_of(path), size=path.stat().st_size, owner=personas.alice, filename=path.name
    )
    with django_capture_on_commit_callbacks(execute=True):
        assert archive_ingest(archive.pk) == ArchiveState.INGESTED
    workload = Workload.objects.get(owner=personas.alice, external_id="job-7")
    comms = set(Series.objects.filter(workload=workload, metric="coll_busbw_gbs").values_list("key", flat=True))
    assert comms == set(workload.communicators.values_list("comm_hash", flat=True))
    stored = Point.objects.count()
    services.archive_summaries_record(archive.pk)  # the task delivered twice: nothing new
    assert Point.objects.count() == stored


def _straggler_job(workload: Workload, culprit: int) -> AnalysisJob:
    return AnalysisJob.objects.create(
        workload=workload,
        kind="stragglers",
        parameters={},
        parameters_key="k",
        state=JobState.DONE,
        result={
            "culprits": [culprit],
            "culprit_groups": [{"group": f"rank={culprit}", "ranks": [culprit], "saves_ms_per_step": 12.0}],
            "ranks": [],
            "slowdown": {},
            "waiting": [],
            "per_step": [],
            "step_source": "labels",
        },
    )


def _two_nodes_with_nics(workload: Workload, errors_on_n2: float) -> None:
    start = now_ns() - 600 * NS
    workload.first_ns, workload.last_ns = start, start + 300 * NS
    workload.save()
    for name, ranks in (("n1", (0, 1)), ("n2", (2, 3))):
        node = Node.objects.create(workload=workload, name=name)
        for r in ranks:
            Rank.objects.create(workload=workload, node=node, rank=r)
    samples = []
    for i in range(60):
        t = start // 1_000_000 + i * 5000
        for node in ("n1", "n2", "n3"):
            samples.append(Sample("nic_rx_bytes_per_s", f"{node}/mlx5_0:1", node, t, 2e10))
            samples.append(
                Sample("nic_errors_per_s", f"{node}/mlx5_0:1", node, t, errors_on_n2 if node == "n2" else 0.0)
            )
            samples.append(Sample("nic_discards_per_s", f"{node}/mlx5_0:1", node, t, 0.0))
    services.points_record(workload.pk, samples)


def test_straggler_page_shows_nic_errors_on_the_culprits_node(personas):
    _two_nodes_with_nics(personas.workload, errors_on_n2=3.0)
    job = _straggler_job(personas.workload, culprit=2)
    client = Client()
    client.force_login(personas.alice)
    page = client.get(reverse("analysis:job", args=[personas.workload.pk, job.pk])).content.decode()
    assert "Network counters of the nodes involved" in page
    assert "NIC counters move with this slowness" in page
    assert "n2 mlx5_0:1: ≈900 errors" in page


def test_straggler_page_says_when_nothing_correlates(personas):
    _two_nodes_with_nics(personas.workload, errors_on_n2=0.0)
    job = _straggler_job(personas.workload, culprit=2)
    client = Client()
    client.force_login(personas.alice)
    page = client.get(reverse("analysis:job", args=[personas.workload.pk, job.pk])).content.decode()
    assert "Nothing correlates" in page
    assert "n2" in page


def test_a_slow_link_names_both_nodes_and_a_port_slower_than_its_peers(personas):
    workload = personas.workload
    _two_nodes_with_nics(workload, errors_on_n2=0.0)
    t = workload.first_ns // 1_000_000
    slow = [Sample("nic_rx_bytes_per_s", "n1/mlx5_0:1", "n1", t + i * 5000 + 1, 2e9) for i in range(60)]
    Point.objects.filter(series__key="n1/mlx5_0:1", series__metric="nic_rx_bytes_per_s").delete()
    services.points_record(workload.pk, slow)
    services.rollups_rebuild(workload.pk)
    result = selectors.nic_correlation(
        workload,
        selectors.analysis_subjects("perf", {"slow_links": [{"src": 0, "dst": 2, "bucket": 20}]}),
        workload.first_ns,
        workload.last_ns,
    )
    (subject,) = result["subjects"]
    assert subject["label"] == "slow link 0 → 2"
    assert subject["nodes"] == ["n1", "n2"]
    assert subject["correlates"]
    assert "n1 mlx5_0:1: throughput 2 GB/s, 10% of the other nodes' median" in subject["verdict"]


def test_an_unknown_range_is_a_clear_400(personas):
    client = Client()
    client.force_login(personas.alice)
    response = client.get(reverse("api-workload-monitoring", args=[personas.workload.pk]), {"range": "3y"})
    assert response.status_code == 400
    assert "range must be one of" in response.json()["detail"]
    later = (timezone.now() - timedelta(hours=1)).isoformat()
    response = client.get(
        reverse("api-workload-monitoring", args=[personas.workload.pk]), {"from": later, "to": "2020-01-01T00:00:00Z"}
    )
    assert response.json()["detail"] == "to must be after from"


def test_stored_bands_give_the_same_chart_and_a_late_point_is_not_lost(personas):
    workload = personas.workload
    end_s = now_ns() // NS
    start_ms = (end_s - 2 * 3600 - 600) * 1000
    workload.last_seen_at = timezone.now()
    workload.save()
    samples = [
        Sample("step_duration_s", str(r), "n1", start_ms + i * 5000, 1.0 + r * 0.01 + (i % 3) * 0.001)
        for r in range(20)
        for i in range(0, 2 * 3600 // 5, 2)
    ]
    services.points_record(workload.pk, samples)
    span = selectors.time_range({"range": "24h"})
    before = selectors.dashboard(workload, span, ["step_duration_s"])[0]["data"]["band"]
    assert services.bands_materialize() > 0  # closed buckets of the last hours are stored
    assert selectors.dashboard(workload, span, ["step_duration_s"])[0]["data"]["band"] == before
    # A late archive brings a slow step into an old, stored bucket: the chart shows it.
    services.points_record(workload.pk, [Sample("step_duration_s", "3", "n1", start_ms + 7, 9.0)])
    after = selectors.dashboard(workload, span, ["step_duration_s"])[0]["data"]["band"]
    assert max(hi for _, _, _, hi, _ in after) == 9.0


# --- Device and NIC counters carried in archives (metrics/samples-*.parquet) -----------------------------------


def _archive_with_samples(owner, tmp_path, rows, node: str = "n1", data: bytes | None = None):
    from apps.workloads.uploads import archive_register
    from comminsight.formats.archive import ArchiveMember, write_archive
    from comminsight.formats.samples import samples_parquet
    from tests.site.archives import manifest_for, segment_bytes, sha256_of

    members = [
        ArchiveMember(f"segments/host-{1000 + r}-1000-0.cilog.sealed", data=segment_bytes(r), records=8) for r in (0, 1)
    ]
    members.append(ArchiveMember("metrics/samples-1.parquet", data=samples_parquet(rows) if data is None else data))
    path = write_archive(tmp_path / f"ci-job-mon-{node}.tar.zst", manifest_for("job-mon", node), members).path
    archive, _ = archive_register(
        source_path=path, sha256=sha256_of(path), size=path.stat().st_size, owner=owner, filename=path.name
    )
    return archive


def _ingest(archive, django_capture_on_commit_callbacks) -> None:
    from apps.workloads.ingest import archive_ingest
    from apps.workloads.models import ArchiveState

    with django_capture_on_commit_callbacks(execute=True):
        assert archive_ingest(archive.pk) == ArchiveState.INGESTED


def _slot(t_ns: int) -> int:
    return t_ns // 5_000_000_000 * 5_000_000_000


def test_device_and_nic_counters_carried_in_an_archive_reach_the_dashboard(
    personas, tmp_path, django_capture_on_commit_callbacks
):
    t = _slot(now_ns()) - 60 * NS
    rows = [
        (t, "gpu", "GPU-aaaa", 0, "util_pct", 91.0),
        (t + 5 * NS, "gpu", "GPU-aaaa", 0, "util_pct", 93.0),
        (t, "gpu", "GPU-aaaa", 0, "sm_clock_mhz", 1980.0),  # not charted: left in the archive
        (t, "nic", "mlx5_0", 1, "rx_bytes_per_s", 1e10),
        (t, "nic", "mlx5_0", 1, "errors_per_s", 2.0),
    ]
    archive = _archive_with_samples(personas.alice, tmp_path, rows)
    _ingest(archive, django_capture_on_commit_callbacks)
    workload = Workload.objects.get(owner=personas.alice, external_id="job-mon")
    client = Client()
    client.force_login(personas.alice)
    charts = charts_of(client, workload, range="15m")
    assert [v for _, v in charts["gpu_util_pct"]["data"]["lines"]["n1/gpu0"]] == [91.0, 93.0]
    assert [v for _, v in charts["nic_rx_bytes_per_s"]["data"]["lines"]["n1/mlx5_0:1"]] == [10.0]  # GB/s
    assert [v for _, v in charts["nic_errors_per_s"]["data"]["lines"]["n1/mlx5_0:1"]] == [2.0]
    stored = Point.objects.count()
    services.archive_summaries_record(archive.pk)  # the task delivered twice: nothing new
    assert Point.objects.count() == stored


def test_archive_counters_fill_only_where_live_heartbeats_were_silent(
    agent, personas, tmp_path, django_capture_on_commit_callbacks
):
    assert post(agent, heartbeat()).status_code == 202  # gpu0 at 97 % now, live
    t = _slot(now_ns())
    rows = [
        (t, "gpu", "GPU-aaaa", 0, "util_pct", 50.0),  # the same moment as the heartbeat's: already drawn
        (t - 5 * NS, "gpu", "GPU-aaaa", 0, "util_pct", 51.0),  # one slot off (two clocks): already drawn
        (t - 120 * NS, "gpu", "GPU-aaaa", 0, "util_pct", 40.0),  # no heartbeat then: filled from the archive
    ]
    archive = _archive_with_samples(personas.alice, tmp_path, rows)
    _ingest(archive, django_capture_on_commit_callbacks)
    workload = Workload.objects.get(owner=personas.alice, external_id="job-mon")
    series = Series.objects.get(workload=workload, metric="gpu_util_pct", key="n1/gpu0")
    values = sorted(Point.objects.filter(series=series).values_list("t_ms", "value"))
    assert [v for _, v in values] == [40.0, 97.0]


def test_an_unusable_samples_table_is_skipped_with_a_log_line_and_the_archive_still_counts(
    personas, tmp_path, django_capture_on_commit_callbacks, caplog
):
    archive = _archive_with_samples(personas.alice, tmp_path, [], data=b"PAR1 but not really")
    with caplog.at_level(logging.WARNING, logger="apps.workloads.ingest"):
        _ingest(archive, django_capture_on_commit_callbacks)
    assert "metrics/samples-1.parquet skipped: not a Parquet table" in caplog.text
    workload = Workload.objects.get(owner=personas.alice, external_id="job-mon")
    assert not Series.objects.filter(workload=workload, metric="gpu_util_pct").exists()
    assert Series.objects.filter(workload=workload, metric="coll_busbw_gbs").exists()
