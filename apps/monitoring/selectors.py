"""Reads of the monitoring app: dashboards (downsampled in the database) and NIC counters next to analyses.

Every read starts from a workload the caller got through ``workloads_visible_to``. A chart never moves more
than a bounded number of rows out of the database whatever the range and job size: the bucket width is
chosen for about ``TARGET_BUCKETS`` points per line, and the source is the coarsest stored resolution that
fits in the bucket (raw points, 1-minute or 10-minute rollups), going coarser while the rows to aggregate
would exceed ``ROW_BUDGET``. Many series (ranks, GPUs) are drawn as min / median / max across them per bucket,
the median taken over each series' bucket mean, in SQL on PostgreSQL.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.contrib.auth.models import AnonymousUser
from django.db import connection
from django.db.models import Avg, Count, ExpressionWrapper, F, FloatField, Max, Min, QuerySet, Sum, Value
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from apps.accounts.models import User
from apps.workloads.models import Rank, Workload, WorkloadStatus
from apps.workloads.selectors import workloads_visible_to

from .metrics import DASHBOARD, METRICS, NIC_METRICS
from .models import RAW_STEP_S, ROLLUP_WIDTHS_S, Band, Point, Rollup, Series

TARGET_BUCKETS = 240
ROW_BUDGET = 150_000
MAX_LINES = 12  # more series than this are drawn as a min/median/max band
NICE_BUCKETS_S = (5, 10, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 10800, 21600, 43200, 86400)
PRESETS = {"15m": 900, "1h": 3600, "6h": 6 * 3600, "24h": 86400, "7d": 7 * 86400}
DEFAULT_PRESET = "1h"
MAX_SPAN_S = 90 * 86400
DISPLAY = {"bytes/s": ("GB/s", 1e9), "bytes": ("GB", 1e9)}


class RangeError(ValueError):
    """A time range that cannot be shown; the message says why."""


@dataclass(frozen=True)
class TimeRange:
    start_ms: int
    end_ms: int
    preset: str  # "" for an explicit from/to
    live: bool  # ends now: new points extend it

    @property
    def span_s(self) -> float:
        return (self.end_ms - self.start_ms) / 1000


def time_range(params: Any, now: datetime | None = None) -> TimeRange:
    """``range=<preset>`` (15m, 1h, 6h, 24h, 7d) or ``from``/``to`` (ISO 8601; ``to`` defaults to now)."""
    now = now or timezone.now()
    now_ms = int(now.timestamp() * 1000)
    start, end = (params.get("from") or "").strip(), (params.get("to") or "").strip()
    if start or end:
        try:
            start_at = parse_datetime(start) if start else None
            end_at = parse_datetime(end) if end else now
        except ValueError:
            start_at = end_at = None
        if start_at is None or end_at is None:
            raise RangeError("from and to must be ISO 8601 times, e.g. 2026-12-03T08:00:00Z")
        if timezone.is_naive(start_at):
            start_at = timezone.make_aware(start_at, timezone.utc)
        if timezone.is_naive(end_at):
            end_at = timezone.make_aware(end_at, timezone.utc)
        if end_at <= start_at:
            raise RangeError("to must be after from")
        if end_at - start_at > timedelta(seconds=MAX_SPAN_S):
            raise RangeError(f"a range may span at most {MAX_SPAN_S // 86400} days")
        end_ms = int(end_at.timestamp() * 1000)
        return TimeRange(int(start_at.timestamp() * 1000), end_ms, "", live=end_ms >= now_ms)
    preset = params.get("range") or DEFAULT_PRESET
    if preset not in PRESETS:
        raise RangeError(f"range must be one of {', '.join(PRESETS)}")
    return TimeRange(now_ms - PRESETS[preset] * 1000, now_ms, preset, live=True)


def resolution(span_s: float, series: int) -> tuple[int, int]:
    """(source, bucket) in seconds for a range of ``span_s`` over ``series`` lines; source 0 is raw points."""
    want = span_s / TARGET_BUCKETS
    bucket = next((b for b in NICE_BUCKETS_S if b >= want), NICE_BUCKETS_S[-1])
    levels = (0, *ROLLUP_WIDTHS_S)
    i = max(j for j, level in enumerate(levels) if level <= bucket)
    while i < len(levels) - 1 and max(series, 1) * span_s / (levels[i] or RAW_STEP_S) > ROW_BUDGET:
        i += 1
    source = levels[i]
    return source, max(bucket, source)


def _per_series_buckets(workload_id: int, metric: str, span: TimeRange, source: int, bucket_s: int) -> QuerySet:
    """One row per (series, bucket): mean, min, max — the downsampling, done by the database."""
    w = bucket_s * 1000
    start = (span.start_ms // w) * w
    if source == 0:
        rows = Point.objects.filter(
            series__workload_id=workload_id, series__metric=metric, t_ms__gte=start, t_ms__lt=span.end_ms
        ).annotate(b=F("t_ms") / Value(w) * Value(w))
        return rows.values("series_id", "b").annotate(mean=Avg("value"), lo=Min("value"), hi=Max("value"))
    rows = Rollup.objects.filter(
        series__workload_id=workload_id,
        series__metric=metric,
        width_s=source,
        bucket_ms__gte=start,
        bucket_ms__lt=span.end_ms,
    )
    if source == bucket_s:  # one rollup row per (series, bucket) already: nothing to group
        mean = ExpressionWrapper(F("total") / F("n"), output_field=FloatField())
        rows = rows.annotate(b=F("bucket_ms"), mean=mean, lo=F("low"), hi=F("high"))
        return rows.values("series_id", "b", "mean", "lo", "hi")
    rows = rows.annotate(b=F("bucket_ms") / Value(w) * Value(w))
    mean = ExpressionWrapper(Sum("total") / Sum("n"), output_field=FloatField())
    return rows.values("series_id", "b").annotate(mean=mean, lo=Min("low"), hi=Max("high"))


def _band(per_series: QuerySet) -> list[tuple[int, float, float, float, int]]:
    """Per bucket: (t_ms, min, median of series means, max, series) — in SQL on PostgreSQL."""
    if connection.vendor == "postgresql":
        sql, params = per_series.query.sql_with_params()
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT b, MIN(lo), percentile_cont(0.5) WITHIN GROUP (ORDER BY mean), MAX(hi), COUNT(*) "  # noqa: S608
                f"FROM ({sql}) per_series GROUP BY b ORDER BY b",
                params,
            )
            return [(int(b), lo, med, hi, n) for b, lo, med, hi, n in cursor.fetchall()]
    buckets: dict[int, list[tuple[float, float, float]]] = defaultdict(list)
    for row in per_series:
        buckets[int(row["b"])].append((row["lo"], row["mean"], row["hi"]))
    return [
        (b, min(r[0] for r in rs), statistics.median(r[1] for r in rs), max(r[2] for r in rs), len(rs))
        for b, rs in sorted(buckets.items())
    ]


def band_from_rollups(workload_id: int, metric: str, width_s: int, start_ms: int, end_ms: int) -> list[tuple]:
    """Per ``width_s`` bucket in ``start_ms``..``end_ms``: (t_ms, min, median, max, series), from the rollups."""
    span = TimeRange(start_ms, end_ms, "", False)
    return _band(_per_series_buckets(workload_id, metric, span, width_s, width_s))


def _spans(buckets: list[int], w: int) -> list[tuple[int, int]]:
    spans: list[list[int]] = []
    for b in buckets:
        if spans and spans[-1][1] == b:
            spans[-1][1] = b + w
        else:
            spans.append([b, b + w])
    return [(a, z) for a, z in spans]


def band_series(workload_id: int, metric: str, span: TimeRange, source: int, bucket_s: int) -> list[tuple]:
    """Min / median / max across series per display bucket. From rollups: the stored bands of closed buckets
    plus, computed now, the buckets not stored yet (the open one, or one that got a late point); a display
    bucket wider than the stored ones takes min of lows, max of highs and the median of their medians."""
    if source == 0:
        return _band(_per_series_buckets(workload_id, metric, span, 0, bucket_s))
    w, display = source * 1000, bucket_s * 1000
    start = (span.start_ms // display) * display
    rows = {
        b: (b, lo, med, hi, n)
        for b, lo, med, hi, n in Band.objects.filter(
            workload_id=workload_id, metric=metric, width_s=source, bucket_ms__gte=start, bucket_ms__lt=span.end_ms
        ).values_list("bucket_ms", "low", "median", "high", "series")
    }
    missing = [b for b in range(start, span.end_ms, w) if b not in rows]
    for a, z in _spans(missing, w):
        rows.update({r[0]: r for r in band_from_rollups(workload_id, metric, source, a, z)})
    fine = [rows[b] for b in sorted(rows)]
    if display == w:
        return fine
    grouped: dict[int, list[tuple]] = defaultdict(list)
    for row in fine:
        grouped[(row[0] // display) * display].append(row)
    return [
        (b, min(r[1] for r in rs), statistics.median(r[2] for r in rs), max(r[3] for r in rs), max(r[4] for r in rs))
        for b, rs in sorted(grouped.items())
    ]


def _lines(per_series: QuerySet, keys: dict[int, str]) -> dict[str, list[tuple[int, float]]]:
    lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for row in per_series.order_by("series_id", "b"):
        lines[keys[row["series_id"]]].append((int(row["b"]), row["mean"]))
    return dict(sorted(lines.items(), key=lambda kv: _natural(kv[0])))


def _natural(key: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in key.replace("/", " ").split())


def _round(value: float | None) -> float | None:
    return None if value is None else float(f"{value:.4g}")


def chart_data(workload: Workload, metric: str, span: TimeRange, series_keys: dict[int, str]) -> dict[str, Any]:
    """The downsampled data of one metric of ``workload`` over ``span`` (``series_keys``: id → key)."""
    source, bucket_s = resolution(span.span_s, len(series_keys))
    scale = DISPLAY.get(METRICS[metric].unit, ("", 1.0))[1]
    data: dict[str, Any] = {
        "metric": metric,
        "source_s": source,
        "bucket_s": bucket_s,
        "series": len(series_keys),
        "start_ms": span.start_ms,
        "end_ms": span.end_ms,
    }
    if len(series_keys) > MAX_LINES:
        data["mode"] = "band"
        data["band"] = [
            (b, _round(lo / scale), _round(med / scale), _round(hi / scale), n)
            for b, lo, med, hi, n in band_series(workload.pk, metric, span, source, bucket_s)
        ]
    else:
        data["mode"] = "lines"
        per_series = _per_series_buckets(workload.pk, metric, span, source, bucket_s)
        data["lines"] = {
            key: [(t, _round(v / scale)) for t, v in points] for key, points in _lines(per_series, series_keys).items()
        }
    return data


def chart_option(data: dict[str, Any]) -> dict[str, Any]:
    """The ECharts option of one chart (frontend/src/charts.ts draws it)."""
    metric = METRICS[data["metric"]]
    unit = DISPLAY.get(metric.unit, (metric.unit, 1.0))[0]
    line = {"type": "line", "showSymbol": False, "connectNulls": False}
    if data["mode"] == "band":
        band = data["band"]
        series = [
            {
                **line,
                "name": "max",
                "data": [[b, hi] for b, _, _, hi, _ in band],
                "lineStyle": {"width": 1, "type": "dashed"},
            },
            {**line, "name": "median", "data": [[b, med] for b, _, med, _, _ in band], "lineStyle": {"width": 2}},
            {
                **line,
                "name": "min",
                "data": [[b, lo] for b, lo, _, _, _ in band],
                "lineStyle": {"width": 1, "type": "dashed"},
            },
        ]
        subtitle = f"min / median / max across {data['series']} {metric.per}s"
    else:
        # A line of one or two points would be invisible without its symbols.
        series = [
            {**line, "name": key, "data": points, "showSymbol": len(points) < 3}
            for key, points in data["lines"].items()
        ]
        subtitle = f"{data['series']} {metric.per}{'' if data['series'] == 1 else 's'}"
    if not any(s["data"] for s in series):
        subtitle = "no data in this range"
    bucket = data["bucket_s"]
    subtitle += f" · {bucket // 60} min buckets" if bucket >= 60 else f" · {bucket} s buckets"
    return {
        "title": {"text": metric.title, "subtext": subtitle, "textStyle": {"fontSize": 14}},
        "tooltip": {"trigger": "axis"},
        "legend": {"type": "scroll", "bottom": 0},
        "grid": {"left": 60, "right": 20, "top": 60, "bottom": 50},
        "xAxis": {
            "type": "time",
            "min": data["start_ms"],
            "max": data["end_ms"],
            "splitNumber": 5,
            "axisLabel": {"hideOverlap": True},
        },
        "yAxis": {"type": "value", "name": unit, "scale": True},
        "series": series,
        "animation": False,
    }


def dashboard(workload: Workload, span: TimeRange, metrics: list[str] | None = None) -> list[dict[str, Any]]:
    """Every chart of ``workload``'s dashboard over ``span``: ``{metric, title, data, option}`` each."""
    wanted = [m for m in (metrics or DASHBOARD) if m in METRICS]
    keys: dict[str, dict[int, str]] = defaultdict(dict)
    for series_id, metric, key in Series.objects.filter(workload=workload, metric__in=wanted).values_list(
        "id", "metric", "key"
    ):
        keys[metric][series_id] = key
    charts = []
    for metric in wanted:
        data = chart_data(workload, metric, span, keys[metric])
        charts.append(
            {
                "metric": metric,
                "title": METRICS[metric].title,
                "element_id": f"chart-{workload.pk}-{metric}",
                "data": data,
                "option": chart_option(data),
            }
        )
    return charts


def running_workloads_visible_to(user: User | AnonymousUser) -> QuerySet[Workload]:
    """Workloads ``user`` may see whose agents report them running or hung, most recently heard first."""
    return (
        workloads_visible_to(user)
        .filter(status__in=[WorkloadStatus.RUNNING, WorkloadStatus.HUNG])
        .order_by("-last_seen_at", "-id")
    )


def workload_metric_counts(workload: Workload) -> dict[str, int]:
    return dict(
        Series.objects.filter(workload=workload).values("metric").annotate(n=Count("id")).values_list("metric", "n")
    )


# --- NIC counters next to a slow rank or link ------------------------------------------------------------------

MAX_SUBJECTS = 10
PEER_SLOW = 0.7  # a port below this share of the other nodes' median throughput is "slower than its peers"
DIP = 0.5  # an interval below this share of the port's own mean throughput is a throughput drop


@dataclass(frozen=True)
class Subject:
    """Something an analysis found slow, and the ranks it involves."""

    label: str
    ranks: tuple[int, ...]


def _nodes_of(workload: Workload, ranks: set[int]) -> dict[int, str]:
    nodes = dict(Rank.objects.filter(workload=workload, rank__in=ranks).values_list("rank", "node__name"))
    missing = {str(r) for r in ranks if r not in nodes}
    if missing:  # live-only workloads: the node that reported the rank's steps
        rows = Series.objects.filter(workload=workload, metric="step_duration_s", key__in=missing).exclude(node="")
        nodes.update({int(k): n for k, n in rows.values_list("key", "node")})
    return nodes


def _port_totals(workload: Workload, span: TimeRange, series: dict[int, tuple[str, str, str]]) -> dict[int, dict]:
    """Per NIC series over the whole span: mean, max and sum of values (one row per series, in SQL)."""
    source, _ = resolution(span.span_s, len(series))
    out: dict[int, dict] = {}
    if source == 0:
        rows = Point.objects.filter(series_id__in=series, t_ms__gte=span.start_ms, t_ms__lt=span.end_ms).values(
            "series_id"
        )
        rows = rows.annotate(n=Count("value"), total=Sum("value"), hi=Max("value"))
    else:
        rows = Rollup.objects.filter(
            series_id__in=series, width_s=source, bucket_ms__gte=span.start_ms, bucket_ms__lt=span.end_ms
        ).values("series_id")
        rows = rows.annotate(n=Sum("n"), total=Sum("total"), hi=Max("high"))
    for row in rows:
        out[row["series_id"]] = {"n": row["n"], "total": row["total"], "max": row["hi"]}
    return out


def _dips(workload: Workload, span: TimeRange, series_ids: list[int]) -> dict[int, tuple[int, int]]:
    """Per throughput series of the involved nodes: (intervals below DIP x its mean, intervals)."""
    if not series_ids:
        return {}
    source, bucket_s = resolution(span.span_s, len(series_ids))
    w = bucket_s * 1000
    if source == 0:
        rows = Point.objects.filter(series_id__in=series_ids, t_ms__gte=span.start_ms, t_ms__lt=span.end_ms)
        rows = rows.annotate(b=F("t_ms") / Value(w)).values("series_id", "b").annotate(mean=Avg("value"))
    else:
        rows = Rollup.objects.filter(
            series_id__in=series_ids, width_s=source, bucket_ms__gte=span.start_ms, bucket_ms__lt=span.end_ms
        ).annotate(b=F("bucket_ms") / Value(w))
        rows = rows.values("series_id", "b").annotate(
            mean=ExpressionWrapper(Sum("total") / Sum("n"), output_field=FloatField())
        )
    means: dict[int, list[float]] = defaultdict(list)
    for row in rows:
        means[row["series_id"]].append(row["mean"])
    out = {}
    for series_id, values in means.items():
        overall = sum(values) / len(values)
        out[series_id] = (sum(1 for v in values if v < DIP * overall) if overall > 0 else 0, len(values))
    return out


def nic_correlation(workload: Workload, subjects: list[Subject], start_ns: int | None, end_ns: int | None) -> dict:
    """The NIC counters of the nodes of each slow subject over ``start_ns``..``end_ns``, and whether they
    correlate: errors or discards on a port, a port slower than the other nodes' ports, or throughput drops.
    ``subjects`` come from an analysis result; the range is the operations it analysed."""
    subjects = subjects[:MAX_SUBJECTS]
    result: dict[str, Any] = {"subjects": [], "has_range": start_ns is not None and end_ns is not None}
    if not subjects or not result["has_range"] or end_ns <= start_ns:  # type: ignore[operator]
        result["has_range"] = False
        return result
    span = TimeRange(start_ns // 1_000_000 - RAW_STEP_S * 1000, end_ns // 1_000_000 + RAW_STEP_S * 1000, "", False)  # type: ignore[operator]
    result["start"] = datetime.fromtimestamp(span.start_ms / 1000, tz=UTC)
    result["end"] = datetime.fromtimestamp(span.end_ms / 1000, tz=UTC)
    nodes_of = _nodes_of(workload, {r for s in subjects for r in s.ranks})
    nic = {
        sid: (metric, key, node)
        for sid, metric, key, node in Series.objects.filter(workload=workload, metric__in=NIC_METRICS).values_list(
            "id", "metric", "key", "node"
        )
    }
    totals = _port_totals(workload, span, nic) if nic else {}
    involved = set(nodes_of.values())
    throughput_ids = [
        sid
        for sid, (m, _, node) in nic.items()
        if node in involved and m in ("nic_rx_bytes_per_s", "nic_tx_bytes_per_s")
    ]
    dips = _dips(workload, span, throughput_ids)
    # Per port: rates are per second and each point stands for RAW_STEP_S seconds.
    ports: dict[tuple[str, str], dict[str, Any]] = {}
    for sid, (metric, key, node) in nic.items():
        t = totals.get(sid)
        if t is None or not t["n"]:
            continue
        port = ports.setdefault(
            (node, key),
            {
                "node": node,
                "port": key.split("/", 1)[-1],
                "throughput": 0.0,
                "dips": (0, 0),
                "errors": None,
                "discards": None,
            },
        )
        if metric == "nic_errors_per_s":
            port["errors"], port["errors_max"] = t["total"] * RAW_STEP_S, t["max"]
        elif metric == "nic_discards_per_s":
            port["discards"], port["discards_max"] = t["total"] * RAW_STEP_S, t["max"]
        else:
            port["throughput"] += t["total"] / t["n"]
            d = dips.get(sid)
            if d:
                port["dips"] = (max(port["dips"][0], d[0]), max(port["dips"][1], d[1]))
    for subject in subjects:
        nodes = sorted({nodes_of[r] for r in subject.ranks if r in nodes_of})
        peers = [p["throughput"] for (node, _), p in ports.items() if node not in nodes and p["throughput"] > 0]
        peer_median = statistics.median(peers) if peers else None
        rows, findings = [], []
        for (node, _), port in sorted(ports.items()):
            if node not in nodes:
                continue
            row = {**port, "throughput_gbs": port["throughput"] / 1e9, "flags": []}
            if port.get("errors"):
                row["flags"].append(f"≈{port['errors']:.0f} errors (peak {port['errors_max']:.3g}/s)")
            if port.get("discards"):
                row["flags"].append(f"≈{port['discards']:.0f} discards (peak {port['discards_max']:.3g}/s)")
            if peer_median and port["throughput"] < PEER_SLOW * peer_median:
                row["flags"].append(
                    f"throughput {port['throughput'] / 1e9:.3g} GB/s, {100 * port['throughput'] / peer_median:.0f}% "
                    "of the other nodes' median"
                )
            low, intervals = port["dips"]
            if low and intervals:
                row["flags"].append(f"throughput below half its mean in {low} of {intervals} intervals")
            row["peer_throughput_gbs"] = peer_median / 1e9 if peer_median else None
            rows.append(row)
            findings += [f"{node} {port['port']}: {f}" for f in row["flags"]]
        if not nodes:
            verdict = "The nodes of these ranks are not known yet (no archive or heartbeat named them)."
        elif not rows:
            verdict = (
                f"No NIC counters were recorded for {', '.join(nodes)} in this range "
                "(agents without the NIC sampler, or data past the retention period)."
            )
        elif findings:
            verdict = "NIC counters move with this slowness: " + "; ".join(findings[:6]) + "."
        else:
            verdict = (
                f"Nothing correlates: no errors, no discards and no throughput drop on the NICs of "
                f"{', '.join(nodes)} over these steps — the network does not explain this slowness."
            )
        result["subjects"].append(
            {"label": subject.label, "nodes": nodes, "ports": rows, "correlates": bool(findings), "verdict": verdict}
        )
    return result


def analysis_subjects(kind: str, result: dict[str, Any] | None) -> list[Subject]:
    """The slow ranks and links a straggler or communication-performance result names."""
    if not isinstance(result, dict):
        return []
    subjects: list[Subject] = []

    def rank(value: Any) -> int | None:
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None

    if kind == "stragglers":
        for group in result.get("culprit_groups") or []:
            ranks = tuple(r for r in (rank(x) for x in (group.get("ranks") or [])) if r is not None)
            if ranks:
                subjects.append(
                    Subject(f"{group.get('group') or 'culprit'} (ranks {', '.join(map(str, ranks[:8]))})", ranks)
                )
        if not subjects:
            subjects = [
                Subject(f"rank {r}", (r,)) for r in (rank(x) for x in result.get("culprits") or []) if r is not None
            ]
    elif kind == "perf":
        for row in result.get("slow_ranks") or []:
            if (r := rank(row.get("rank"))) is not None:
                subjects.append(Subject(f"slow rank {r}", (r,)))
        for row in result.get("slow_links") or []:
            src, dst = rank(row.get("src")), rank(row.get("dst"))
            if src is not None and dst is not None:
                subjects.append(Subject(f"slow link {src} → {dst}", (src, dst)))
    return subjects[:MAX_SUBJECTS]
