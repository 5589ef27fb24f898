"""Time series of a workload: one row per (series, time) point, plus per-minute and per-ten-minute rollups.

A ``Series`` is one line on a chart: a metric (``step_duration_s``, ``gpu_util_pct``, ...) of one thing of one
workload (a rank, a communicator, a node, a GPU, a NIC port). Points are narrow rows keyed by
``(series, t_ms)`` — the primary key *is* the (workload's series, time) index, so a range scan of one series
reads one contiguous stretch of the index and re-recording a point is a no-op. ``Rollup`` keeps count, sum,
min and max per series and bucket at two widths, maintained as points arrive, so a dashboard over a day of a
1,000-rank job reads rollups instead of millions of points (see ``selectors.chart_series``).
Times are integer milliseconds since the epoch (UTC): bucketing is integer arithmetic in any database.
"""

from __future__ import annotations

from django.db import models

from apps.workloads.models import Workload

# Native resolution of heartbeat series (agents sample every 5 s by default) and the rollup widths kept.
RAW_STEP_S = 5
ROLLUP_WIDTHS_S = (60, 600)


class Series(models.Model):
    workload = models.ForeignKey(Workload, on_delete=models.CASCADE, related_name="monitoring_series")
    metric = models.CharField(max_length=40)
    key = models.CharField(max_length=255)  # "5" (rank), "0x…" (communicator), "node-a/gpu0", "node-a/mlx5_0:1"
    node = models.CharField(max_length=200, blank=True, default="")  # where the thing lives, when known

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["workload", "metric", "key"], name="monitoring_series_per_workload")
        ]

    def __str__(self) -> str:
        return f"{self.metric}[{self.key}]"


class Point(models.Model):
    pk = models.CompositePrimaryKey("series", "t_ms")
    # The primary key's leading column already indexes the series: no second index.
    series = models.ForeignKey(Series, on_delete=models.CASCADE, related_name="+", db_index=False)
    t_ms = models.BigIntegerField()
    value = models.FloatField()

    def __str__(self) -> str:
        return f"{self.series_id}@{self.t_ms}={self.value}"


class Rollup(models.Model):
    pk = models.CompositePrimaryKey("series", "width_s", "bucket_ms")
    series = models.ForeignKey(Series, on_delete=models.CASCADE, related_name="+", db_index=False)
    width_s = models.IntegerField()
    bucket_ms = models.BigIntegerField()  # start of the bucket, a multiple of width_s * 1000
    n = models.IntegerField()
    total = models.FloatField()
    low = models.FloatField()
    high = models.FloatField()

    def __str__(self) -> str:
        return f"{self.series_id}/{self.width_s}s@{self.bucket_ms}"


class Band(models.Model):
    """Min / median / max across the series of a metric per rollup bucket: what a dashboard draws for many
    ranks or GPUs. Kept for closed buckets by the periodic task (``services.bands_materialize``) so a day of
    a 1,000-rank job is ~150 rows to read; a bucket that gets a late point loses its row and is recomputed."""

    pk = models.CompositePrimaryKey("workload", "metric", "width_s", "bucket_ms")
    workload = models.ForeignKey(Workload, on_delete=models.CASCADE, related_name="+", db_index=False)
    metric = models.CharField(max_length=40)
    width_s = models.IntegerField()
    bucket_ms = models.BigIntegerField()
    series = models.IntegerField()
    low = models.FloatField()
    median = models.FloatField()
    high = models.FloatField()

    def __str__(self) -> str:
        return f"{self.workload_id}/{self.metric}/{self.width_s}s@{self.bucket_ms}"
