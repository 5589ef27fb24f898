"""Monitoring dashboard query: a 24-hour range of a 1,000-rank job at one point per 5 s.

Fills a throw-away PostgreSQL database with ``--ranks`` step-time series of ``--hours`` hours at one point per
``--step-s`` seconds (1,000 x 24 h x 5 s = 17.28 M points; generated in SQL, then the rollups are built by
``services.rollups_rebuild``, the same code that repairs them on a site), and times, in the same run:
  - dashboard: ``selectors.dashboard`` for the step-time chart over the full range, as the page and API call it
    (min / median / max across ranks per bucket: the bands the periodic task stores, plus any bucket not stored
    yet computed from the rollups);
  - the same chart computed from the 10-minute rollups alone (no stored bands);
  - baseline:  the same chart computed from the raw points (same buckets, same SQL aggregate; no rollups).
Prints milliseconds (median of --repeat runs) and the ratio. Target (DESIGN §9): <= 200 ms.
It also times ``services.points_record`` writing one minute of heartbeats of every rank (points per second).

Run: .venv/bin/python bench/monitoring_dashboard.py [--ranks 1000] [--hours 24] [--step-s 5] [--repeat 5] [--keep]
Needs PostgreSQL: BENCH_DATABASE_URL (default postgres://postgres@127.0.0.1:5432/ci_bench_monitoring), created
and dropped by the run unless --keep (then a second run reuses the filled database).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import psycopg

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/ci_bench_monitoring"


def timed(fn, repeat: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000, result


def ensure_database(url: str) -> bool:
    """Create the database when missing; return True when it already existed."""
    parts = urlsplit(url)
    name = parts.path.lstrip("/")
    admin = parts._replace(path="/postgres").geturl()
    with psycopg.connect(admin, autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            return True
        conn.execute(f'CREATE DATABASE "{name}"')
        return False


def drop_database(url: str) -> None:
    parts = urlsplit(url)
    with psycopg.connect(parts._replace(path="/postgres").geturl(), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{parts.path.lstrip("/")}" WITH (FORCE)')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=1000)
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--step-s", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--baseline-repeat", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the filled database for the next run")
    args = parser.parse_args()

    url = os.environ.get("BENCH_DATABASE_URL", DEFAULT_URL)
    existed = ensure_database(url)
    os.environ["DATABASE_URL"] = url
    os.environ.pop("REDIS_URL", None)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "comminsight_site.settings")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection
    from django.utils import timezone

    from apps.accounts.models import User
    from apps.monitoring import selectors, services
    from apps.monitoring.models import Point, Series
    from apps.workloads.models import Workload

    call_command("migrate", verbosity=0)
    owner, _ = User.objects.get_or_create(username="bench-monitoring")
    name = f"bench-{args.ranks}r-{args.hours:g}h-{args.step_s}s"
    workload, created = Workload.objects.get_or_create(owner=owner, external_id=name, defaults={"name": name})
    end_ms = int(timezone.now().timestamp() * 1000)
    span_ms = int(args.hours * 3600 * 1000)
    points = Point.objects.filter(series__workload=workload).count() if not created else 0
    expected = args.ranks * (span_ms // (args.step_s * 1000))
    if points < expected:
        Series.objects.filter(workload=workload).delete()
        Series.objects.bulk_create(
            [
                Series(workload=workload, metric="step_duration_s", key=str(r), node=f"node-{r // 8}")
                for r in range(args.ranks)
            ]
        )
        started = time.perf_counter()
        with connection.cursor() as cursor:
            # Steps of ~1.4 s with per-rank offsets and noise; one rank per 100 slower (stragglers).
            cursor.execute(
                "INSERT INTO monitoring_point (series_id, t_ms, value) "
                "SELECT s.id, t, 1.4 + (CASE WHEN s.key::int %% 100 = 7 THEN 0.3 ELSE 0 END) + random() * 0.05 "
                "FROM monitoring_series s, generate_series(%s::bigint, %s::bigint, %s::bigint) t "
                "WHERE s.workload_id = %s ORDER BY s.id, t",
                [end_ms - span_ms, end_ms - args.step_s * 1000, args.step_s * 1000, workload.pk],
            )
            filled = cursor.rowcount
        fill_s = time.perf_counter() - started
        started = time.perf_counter()
        rollups = services.rollups_rebuild(workload.pk)
        rollup_s = time.perf_counter() - started
        started = time.perf_counter()
        bands = services.bands_rebuild(workload.pk)
        band_s = time.perf_counter() - started
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE monitoring_point; ANALYZE monitoring_rollup; ANALYZE monitoring_series")
        print(f"filled {filled:,} points in {fill_s:.1f} s; {rollups:,} rollup rows rebuilt in {rollup_s:.1f} s")
        print(f"{bands:,} bands across ranks (the periodic task's work) rebuilt in {band_s:.1f} s")
    else:
        end_ms = Point.objects.filter(series__workload=workload).order_by("-t_ms").values_list("t_ms", flat=True)[0]
        end_ms += args.step_s * 1000
        print(f"reusing {points:,} points")

    span = selectors.TimeRange(end_ms - span_ms, end_ms, "", live=False)
    keys = dict(Series.objects.filter(workload=workload, metric="step_duration_s").values_list("id", "key"))
    source, bucket = selectors.resolution(span.span_s, len(keys))
    dashboard_ms, charts = timed(lambda: selectors.dashboard(workload, span, ["step_duration_s"]), args.repeat)
    band = charts[0]["data"]["band"]

    def rollup_chart():
        return selectors.band_from_rollups(workload.pk, "step_duration_s", source, span.start_ms, span.end_ms)

    rollups_ms = timed(rollup_chart, args.baseline_repeat)[0] if source else float("nan")

    def raw_chart():
        return selectors._band(selectors._per_series_buckets(workload.pk, "step_duration_s", span, 0, bucket))

    baseline_ms, raw_band = timed(raw_chart, args.baseline_repeat)
    same = len(raw_band) == len(band) and all(
        abs(a[2] - b[2]) <= 1e-3 * abs(b[2]) + 1e-3 for a, b in zip(band, raw_band, strict=True)
    )

    # Writing: one minute of heartbeats of every rank (12 points each), through the service agents reach.
    write_end = end_ms + 60_000
    minute = [
        services.Sample("step_duration_s", str(r), f"node-{r // 8}", write_end - i * 5000, 1.4)
        for r in range(args.ranks)
        for i in range(12)
    ]
    started = time.perf_counter()
    written = services.points_record(workload.pk, minute)
    write_s = time.perf_counter() - started
    Point.objects.filter(series__workload=workload, t_ms__gt=end_ms).delete()

    print(f"job: {args.ranks} ranks x {args.hours:g} h at one point per {args.step_s} s = {expected:,} points")
    where = f"the {source} s rollups" if source else "the raw points"
    print(f"chart: {len(band)} buckets of {bucket} s from {where}, min/median/max across {len(keys)} ranks")
    print(f"dashboard query (stored bands + rollups):      {dashboard_ms:8.1f} ms   (target <= 200 ms)")
    print(f"  without stored bands (rollups only):         {rollups_ms:8.1f} ms")
    print(f"baseline (same chart from raw points):         {baseline_ms:8.1f} ms")
    print(f"ratio baseline / dashboard: x{baseline_ms / dashboard_ms:.1f}; same medians: {same}")
    print(f"points_record: {written:,} points in {write_s * 1000:.0f} ms ({written / write_s:,.0f} points/s)")
    connection.close()
    if not args.keep and not existed:
        drop_database(url)


if __name__ == "__main__":
    main()
