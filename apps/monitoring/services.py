"""Writes of the monitoring app: points from live heartbeats and from ingested archives, rollups, purge.

Every writer ends in ``points_record``: series are found or created in one pass, points are inserted in
bulk with ``ON CONFLICT DO NOTHING`` (a point already stored is never counted twice, so a heartbeat or an
archive processed again changes nothing), and only the rows actually inserted update the rollups.

Heartbeats carry values measured by agents we do not control: a value of the wrong type, a negative rate
(a counter that went backwards) or a missing field is skipped with one log line per heartbeat naming each
problem; the heartbeat itself is never refused for it (``heartbeat_samples``).
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import InterfaceError, OperationalError, connection, transaction
from django.db.models import Count, Exists, Max, Min, OuterRef, Q
from django.utils import timezone

from apps.workloads.models import Archive, ArchiveState, Workload, WorkloadStatus
from comminsight_site import rows

from .metrics import METRICS
from .models import RAW_STEP_S, ROLLUP_WIDTHS_S, Band, Point, Rollup, Series

logger = logging.getLogger(__name__)

# The SQL below (noqa: S608) is built only from model table names and placeholders; values are parameters.
INSERT_CHUNK = 2000  # rows per INSERT statement (3 or 7 parameters each: well under SQLite's limit)
MAX_ENTRIES = 65_536  # entries read from one list of a heartbeat
NIC_DEVICE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
MAX_FUTURE_S = 3600  # agents' clocks may run ahead; beyond this a timestamp is not believed
MAX_STEP_S = 86_400.0
BAND_GRACE_S = 300  # a bucket is closed this long after its end (archives arrive up to an interval late)
BAND_LOOKBACK_S = 3 * 3600  # how far back the periodic task looks for bands to materialise


@dataclass(frozen=True)
class Sample:
    metric: str
    key: str
    node: str
    t_ms: int
    value: float


# --- Recording ------------------------------------------------------------------------------------------------


def _series_ids(workload_id: int, samples: list[Sample]) -> dict[tuple[str, str], int]:
    wanted = {(s.metric, s.key): s.node for s in samples}
    found: dict[tuple[str, str], int] = {}

    def look() -> None:
        # A bare statement: every heartbeat looks its series up, and the ORM's query cost several times more.
        metrics, keys = sorted({m for m, _ in wanted}), sorted({k for _, k in wanted})
        metric, key = rows.column(Series, "metric"), rows.column(Series, "key")
        sql = (
            f"SELECT {metric}, {key}, {rows.column(Series, 'id')} FROM {rows.table(Series)} "  # noqa: S608
            f"WHERE {rows.column(Series, 'workload')} = %s AND {metric} IN ({', '.join(['%s'] * len(metrics))}) "
            f"AND {key} IN ({', '.join(['%s'] * len(keys))})"
        )
        with rows.cursor() as cursor:
            cursor.execute(sql, [workload_id, *metrics, *keys])
            found.update({(m, k): i for m, k, i in cursor.fetchall() if (m, k) in wanted})

    look()
    missing = [
        Series(workload_id=workload_id, metric=m, key=k, node=n) for (m, k), n in wanted.items() if (m, k) not in found
    ]
    if missing:
        # A concurrent writer may create the same series: ignore the conflict and read the ids back.
        Series.objects.bulk_create(missing, ignore_conflicts=True)
        look()
    return found


def _rollup_rows(inserted: Iterable[tuple[int, int, float]]) -> list[tuple[int, int, int, int, float, float, float]]:
    acc: dict[tuple[int, int, int], list[float]] = {}
    for series_id, t_ms, value in inserted:
        for width in ROLLUP_WIDTHS_S:
            w = width * 1000
            key = (series_id, width, (t_ms // w) * w)
            cur = acc.get(key)
            if cur is None:
                acc[key] = [1, value, value, value]
            else:
                cur[0] += 1
                cur[1] += value
                cur[2] = min(cur[2], value)
                cur[3] = max(cur[3], value)
    # Sorted: concurrent writers lock shared rows (the workload-wide series) in one order, never deadlocking.
    return [(s, w, b, int(n), t, lo, hi) for (s, w, b), (n, t, lo, hi) in sorted(acc.items())]


def points_record(workload_id: int, samples: list[Sample]) -> int:
    """Store ``samples`` (new points only) and fold them into the rollups; return how many were new."""
    if not samples:
        return 0
    ids = _series_ids(workload_id, samples)
    by_point = {(ids[(s.metric, s.key)], s.t_ms): s.value for s in samples}  # one value per (series, time)
    point_table = Point._meta.db_table
    rollup_table = Rollup._meta.db_table
    inserted: list[tuple[int, int, float]] = []
    items = sorted(by_point.items())
    with transaction.atomic(), rows.cursor() as cursor:
        for i in range(0, len(items), INSERT_CHUNK):
            chunk = items[i : i + INSERT_CHUNK]
            values = ",".join(["(%s,%s,%s)"] * len(chunk))
            params = [p for (series_id, t_ms), value in chunk for p in (series_id, t_ms, value)]
            cursor.execute(
                f"INSERT INTO {point_table} (series_id, t_ms, value) VALUES {values} "  # noqa: S608
                "ON CONFLICT (series_id, t_ms) DO NOTHING RETURNING series_id, t_ms, value",
                params,
            )
            inserted.extend(cursor.fetchall())
        _bands_invalidate(workload_id, samples, ids, inserted)
        rollups = _rollup_rows(inserted)
        for i in range(0, len(rollups), INSERT_CHUNK):
            chunk = rollups[i : i + INSERT_CHUNK]
            values = ",".join(["(%s,%s,%s,%s,%s,%s,%s)"] * len(chunk))
            cursor.execute(
                f"INSERT INTO {rollup_table} AS r (series_id, width_s, bucket_ms, n, total, low, high) "  # noqa: S608
                f"VALUES {values} ON CONFLICT (series_id, width_s, bucket_ms) DO UPDATE SET "
                "n = r.n + excluded.n, total = r.total + excluded.total, "
                "low = CASE WHEN excluded.low < r.low THEN excluded.low ELSE r.low END, "
                "high = CASE WHEN excluded.high > r.high THEN excluded.high ELSE r.high END",
                [p for row in chunk for p in row],
            )
    return len(inserted)


def _bands_invalidate(
    workload_id: int, samples: list[Sample], ids: dict[tuple[str, str], int], inserted: list[tuple[int, int, float]]
) -> None:
    """A point landing in a closed, already materialised bucket (a late archive) removes that bucket's band."""
    closed_before = int(timezone.now().timestamp() * 1000) - BAND_GRACE_S * 1000
    metric_of = {series_id: metric for (metric, _), series_id in ids.items()}
    touched: dict[tuple[str, int], list[int]] = defaultdict(list)
    for series_id, t_ms, _ in inserted:
        for width in ROLLUP_WIDTHS_S:
            w = width * 1000
            bucket = (t_ms // w) * w
            if bucket + w <= closed_before:
                touched[(metric_of[series_id], width)].append(bucket)
    for (metric, width), buckets in touched.items():
        Band.objects.filter(
            workload_id=workload_id,
            metric=metric,
            width_s=width,
            bucket_ms__gte=min(buckets),
            bucket_ms__lte=max(buckets),
        ).delete()


def rollups_rebuild(workload_id: int) -> int:
    """Recompute every rollup of ``workload_id`` from its points (repair, and bulk loads that bypass
    ``points_record``); return the number of rollup rows written. One statement per width, in SQL."""
    point_table, rollup_table, series_table = Point._meta.db_table, Rollup._meta.db_table, Series._meta.db_table
    written = 0
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            f"DELETE FROM {rollup_table} WHERE series_id IN "  # noqa: S608
            f"(SELECT id FROM {series_table} WHERE workload_id = %s)",
            [workload_id],
        )
        for width in ROLLUP_WIDTHS_S:
            w = width * 1000
            cursor.execute(
                f"INSERT INTO {rollup_table} (series_id, width_s, bucket_ms, n, total, low, high) "  # noqa: S608
                f"SELECT p.series_id, %s, (p.t_ms / %s) * %s, COUNT(*), SUM(p.value), MIN(p.value), MAX(p.value) "
                f"FROM {point_table} p JOIN {series_table} s ON s.id = p.series_id WHERE s.workload_id = %s "
                "GROUP BY p.series_id, (p.t_ms / %s) * %s",
                [width, w, w, workload_id, w, w],
            )
            written += cursor.rowcount
    return written


# --- Live heartbeats --------------------------------------------------------------------------------------------


class _Reader:
    """Reads one heartbeat's optional keys (docs/formats/upload.md), collecting what it had to skip."""

    def __init__(self, node: str, slot_ms: int, now_ms: int) -> None:
        self.node = node
        self.slot_ms = slot_ms
        self.now_ms = now_ms
        self.samples: list[Sample] = []
        self.problems: list[str] = []

    def number(self, value: Any, where: str, high: float | None = None) -> float | None:
        """A measured value: None when not measured (null or absent); a problem when unusable."""
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.problems.append(f"{where}: not a number ({type(value).__name__})")
            return None
        v = float(value)
        if not math.isfinite(v):
            self.problems.append(f"{where}: not finite")
            return None
        if v < 0:
            self.problems.append(f"{where}: negative ({v:g}); a counter that went backwards must be sent as null")
            return None
        if high is not None and v > high:
            self.problems.append(f"{where}: {v:g} is above {high:g}")
            return None
        return v

    def index(self, value: Any, where: str) -> int | None:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 31:
            self.problems.append(f"{where}: missing or not a non-negative integer")
            return None
        return value

    def entries(self, value: Any, where: str) -> list[dict[str, Any]]:
        if value is None:
            return []
        if not isinstance(value, list):
            self.problems.append(f"{where}: not a list")
            return []
        if len(value) > MAX_ENTRIES:
            self.problems.append(f"{where}: {len(value)} entries, only the first {MAX_ENTRIES} read")
        out = []
        for i, entry in enumerate(value[:MAX_ENTRIES]):
            if isinstance(entry, dict):
                out.append(entry)
            else:
                self.problems.append(f"{where}[{i}]: not an object")
        return out

    def add(self, metric: str, key: str, value: float | None, t_ms: int | None = None, node: str | None = None) -> None:
        if value is not None:
            self.samples.append(Sample(metric, key, self.node if node is None else node, t_ms or self.slot_ms, value))

    def steps(self, value: Any) -> None:
        for i, step in enumerate(self.entries(value, "steps")):
            rank = self.index(step.get("rank"), f"steps[{i}].rank")
            duration = self.number(step.get("duration_s"), f"steps[{i}].duration_s", high=MAX_STEP_S)
            end_ns = step.get("end_ns")
            # A step is placed at its end; without a believable end it cannot be placed (and repeating
            # heartbeats would record it again), so it is skipped.
            if (
                isinstance(end_ns, bool)
                or not isinstance(end_ns, int)
                or not 0 < end_ns // 1_000_000 <= self.now_ms + MAX_FUTURE_S * 1000
            ):
                if duration is not None:
                    self.problems.append(f"steps[{i}].end_ns: missing or not a plausible time")
                continue
            if rank is not None:
                self.add("step_duration_s", str(rank), duration, t_ms=end_ns // 1_000_000)

    def devices(self, value: Any) -> None:
        for i, device in enumerate(self.entries(value, "devices")):
            gpu = self.index(device.get("gpu"), f"devices[{i}].gpu")
            if gpu is None:
                continue
            key = f"{self.node}/gpu{gpu}"
            self.add("gpu_util_pct", key, self.number(device.get("util_pct"), f"devices[{i}].util_pct", high=100.0))
            self.add(
                "gpu_mem_used_bytes", key, self.number(device.get("mem_used_bytes"), f"devices[{i}].mem_used_bytes")
            )
            self.add("gpu_power_w", key, self.number(device.get("power_w"), f"devices[{i}].power_w"))

    def nics(self, value: Any) -> None:
        for i, nic in enumerate(self.entries(value, "nics")):
            device, port = nic.get("device"), self.index(nic.get("port"), f"nics[{i}].port")
            if not isinstance(device, str) or not NIC_DEVICE.match(device):
                self.problems.append(f"nics[{i}].device: missing or not a device name")
                continue
            if port is None:
                continue
            key = f"{self.node}/{device}:{port}"
            for field, metric in (
                ("rx_bytes_per_s", "nic_rx_bytes_per_s"),
                ("tx_bytes_per_s", "nic_tx_bytes_per_s"),
                ("errors_per_s", "nic_errors_per_s"),
                ("discards_per_s", "nic_discards_per_s"),
            ):
                self.add(metric, key, self.number(nic.get(field), f"nics[{i}].{field}"))

    def agent(self, value: Any, communicators: Any) -> None:
        agent = value if isinstance(value, dict) else {}
        if value is not None and not isinstance(value, dict):
            self.problems.append("agent: not an object")
        self.add("agent_records_per_s", self.node, self.number(agent.get("records_per_s"), "agent.records_per_s"))
        self.add("agent_cpu_pct", self.node, self.number(agent.get("cpu_pct"), "agent.cpu_pct"))
        self.add("dropped_records", self.node, self.number(agent.get("dropped_records"), "agent.dropped_records"))
        inflight = self.number(agent.get("inflight_ops"), "agent.inflight_ops")
        if inflight is None and isinstance(communicators, list):  # older agents: sum the communicators' counts
            counts = [c.get("inflight") for c in communicators if isinstance(c, dict)]
            numbers = [c for c in counts if isinstance(c, int) and not isinstance(c, bool) and c >= 0]
            inflight = float(sum(numbers)) if numbers else None
        self.add("inflight_ops", self.node, inflight)


def heartbeat_samples(
    node: str, heartbeat: dict[str, Any], live_summary: dict[str, Any] | None, at: datetime
) -> tuple[list[Sample], list[str]]:
    """The points one heartbeat of ``node`` contributes, and the problems met reading it.

    Node-level values are placed on the 5-second grid at the time the site received them (agents'
    clocks may differ; a heartbeat repeated within a slot adds nothing); steps at their own end time.
    """
    now_ms = int(at.timestamp() * 1000)
    reader = _Reader(node, (now_ms // (RAW_STEP_S * 1000)) * RAW_STEP_S * 1000, now_ms)
    reader.steps(heartbeat.get("steps"))
    reader.devices(heartbeat.get("devices"))
    reader.nics(heartbeat.get("nics"))
    reader.agent(heartbeat.get("agent"), heartbeat.get("communicators"))
    lagging = (live_summary or {}).get("lagging_ranks")
    if isinstance(lagging, list):  # the cross-node view, once per slot for the whole workload
        reader.add("lagging_ranks", "all", float(len(lagging)), node="")
    return reader.samples, reader.problems


class StoredPoints:
    """The points (workload, metric, key, time) this process stored from heartbeats lately, known committed.

    A point is stored once (``ON CONFLICT DO NOTHING``): a second heartbeat in the same 5-second slot adds nothing to
    node-level series, and the workload-wide ``lagging_ranks`` point is the same for every node of the job in a
    slot. Such a heartbeat stored nothing but cost the series lookup and a transaction (four round trips); with
    this, samples already stored by this process are not sent again, and a heartbeat with nothing new makes no
    statement at all. Only points whose transaction committed are kept (``transaction.on_commit``), so a rolled
    back write is written again. Points placed more than ``keep_ms`` before or after now are not kept (no heartbeat
    is placed in a slot that old any more; a step placed that far from now, such as by an agent whose clock runs
    ahead, is simply sent again: the database keeps it once), so what is kept is bounded by the points of a few
    slots, however the agents' clocks stand.
    A workload created or deleted is forgotten (``stored_points_forget``): its id may name other rows than before
    (SQLite reuses the id of a rolled-back row). ``clock`` is injectable for tests."""

    def __init__(self, keep_ms: int = 2 * RAW_STEP_S * 1000, clock: Callable[[], float] = time.time) -> None:
        self.keep_ms, self.clock = keep_ms, clock
        self._points: dict[tuple[int, str, str, int], None] = {}
        self._earliest = math.inf  # no kept point is placed before this
        self._lock = threading.Lock()

    def new(self, workload_id: int, samples: list[Sample]) -> list[Sample]:
        """The samples of ``samples`` not known stored."""
        points = self._points
        return [s for s in samples if (workload_id, s.metric, s.key, s.t_ms) not in points]

    def add(self, workload_id: int, samples: list[Sample]) -> None:
        with self._lock:
            now_ms = int(self.clock() * 1000)
            oldest, newest = now_ms - self.keep_ms, now_ms + self.keep_ms
            if self._earliest < oldest:  # a kept point has aged: drop all aged (about once a slot)
                self._points = {point: None for point in self._points if point[3] >= oldest}
                self._earliest = min((point[3] for point in self._points), default=math.inf)
            for s in samples:
                if oldest <= s.t_ms <= newest:
                    self._points[(workload_id, s.metric, s.key, s.t_ms)] = None
                    self._earliest = min(self._earliest, s.t_ms)

    def forget(self, workload_id: int) -> None:
        """Forget the points of ``workload_id`` (its row was created or deleted: the id is not what it was)."""
        with self._lock:
            self._points = {point: None for point in self._points if point[0] != workload_id}


_stored_points = StoredPoints()


def stored_points_forget(workload_id: int) -> None:
    _stored_points.forget(workload_id)


def monitoring_record_heartbeat(*, workload: Workload, node: str, heartbeat: dict[str, Any], at: datetime) -> int:
    """Keep what a heartbeat measured as time series; never raises (a heartbeat is not lost for its metrics).
    Points this process already stored are not sent again (``StoredPoints``)."""
    try:
        samples, problems = heartbeat_samples(node, heartbeat, workload.live_summary, at)
        if problems:
            logger.warning(
                "heartbeat of workload %s node %r: %d value(s) skipped: %s",
                workload.pk,
                node,
                len(problems),
                "; ".join(problems[:20]) + (" …" if len(problems) > 20 else ""),
            )
        samples = _stored_points.new(workload.pk, samples)
        if not samples:
            return 0
        added = points_record(workload.pk, samples)
    except Exception:
        logger.exception("could not record the metrics of a heartbeat of workload %s node %r", workload.pk, node)
        return 0
    transaction.on_commit(lambda: _stored_points.add(workload.pk, samples))
    if added:
        transaction.on_commit(lambda: publish_points(workload.pk, sorted({s.metric for s in samples})))
    return added


# --- Archive summaries --------------------------------------------------------------------------------------------

STEP_CONTEXT_NS = 60 * 1_000_000_000  # earlier operations read with an archive so its first steps are whole


def archive_samples(operations: Any, first_ns: int, last_ns: int, node: str) -> list[Sample]:
    """Step time per rank and throughput per communicator of one node's operations in an archive's window.

    ``operations`` (the operations table, polars) spans ``first_ns - STEP_CONTEXT_NS`` .. ``last_ns``: each
    rank's first recovered step (cut by the window) and last (maybe unfinished) are left out; the next
    archive's window covers them. Points are placed at the step's end, so a step seen by two windows is
    one point. Throughput is the samples-weighted mean over (op, size) of ``analyse_perf``'s medians, placed
    at the archive's end: the communicator as this node's ranks saw it.
    """
    import polars as pl

    from comminsight.analysis.perf import analyse_perf
    from comminsight.semantic import recover_steps

    samples: list[Sample] = []
    comm = operations.filter(pl.col("op") != "progress")
    if comm.height == 0:
        return samples
    steps = recover_steps(comm).rank_steps
    if steps.height:
        whole = (
            steps.filter((pl.col("step") >= 0) & (pl.col("end_ns") > pl.col("start_ns")))
            .sort("rank", "start_ns")
            .with_columns(first=pl.col("start_ns").min().over("rank"), last=pl.col("start_ns").max().over("rank"))
            .filter((pl.col("start_ns") > pl.col("first")) & (pl.col("start_ns") < pl.col("last")))
        )
        for rank, start_ns, end_ns in whole.select("rank", "start_ns", "end_ns").iter_rows():
            samples.append(Sample("step_duration_s", str(rank), node, end_ns // 1_000_000, (end_ns - start_ns) / 1e9))
    perf = analyse_perf(comm)
    per_comm: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for row in perf.get("bandwidth") or []:
        n = float(row.get("samples") or 0)
        if n and row.get("algbw_gbs") is not None and row.get("busbw_gbs") is not None:
            acc = per_comm[str(row["comm_id"])]
            acc[0] += n
            acc[1] += n * float(row["algbw_gbs"])
            acc[2] += n * float(row["busbw_gbs"])
    t_ms = last_ns // 1_000_000
    for comm_id, (n, algbw, busbw) in sorted(per_comm.items()):
        samples.append(Sample("coll_algbw_gbs", comm_id[:255], "", t_ms, algbw / n))
        samples.append(Sample("coll_busbw_gbs", comm_id[:255], "", t_ms, busbw / n))
    return samples


# Device and NIC samples an archive carries (docs/formats/archive.md, metrics/): sampler field -> site metric.
ARCHIVE_DEVICE_METRICS = {
    "gpu": {"util_pct": "gpu_util_pct", "mem_used_bytes": "gpu_mem_used_bytes", "power_w": "gpu_power_w"},
    "nic": {
        "rx_bytes_per_s": "nic_rx_bytes_per_s",
        "tx_bytes_per_s": "nic_tx_bytes_per_s",
        "errors_per_s": "nic_errors_per_s",
        "discards_per_s": "nic_discards_per_s",
    },
}


def archive_device_samples(table: Any, node: str) -> list[Sample]:
    """The GPU and NIC points of one archive's samples table (``comminsight.formats.samples``) of ``node``:
    the same series as heartbeats give (``<node>/gpu<i>``, ``<node>/<device>:<port>``), on the 5-second grid
    at the agent's own sample time. Negative values, utilisation above 100 and bad device names are left out."""
    import polars as pl

    frame = pl.from_arrow(table)
    assert isinstance(frame, pl.DataFrame)
    mapping = pl.DataFrame(
        [(kind, field, metric) for kind, fields in ARCHIVE_DEVICE_METRICS.items() for field, metric in fields.items()],
        schema={"kind": pl.String, "metric": pl.String, "site_metric": pl.String},
        orient="row",
    )
    slot = RAW_STEP_S * 1000
    rows = (
        frame.join(mapping, on=["kind", "metric"])
        .filter(
            (pl.col("value") >= 0)
            & ((pl.col("site_metric") != "gpu_util_pct") | (pl.col("value") <= 100.0))
            & ((pl.col("kind") == "gpu") | pl.col("device").str.contains(NIC_DEVICE.pattern))
            & pl.col("port").is_not_null()
            & (pl.col("port") >= 0)
        )
        .with_columns(
            key=pl.when(pl.col("kind") == "gpu")
            .then(pl.format("{}/gpu{}", pl.lit(node), pl.col("port")))
            .otherwise(pl.format("{}/{}:{}", pl.lit(node), pl.col("device"), pl.col("port"))),
            t_ms=(pl.col("time_ns") // 1_000_000 // slot) * slot,
        )
        .group_by("site_metric", "key", "t_ms")
        .agg(pl.col("value").last())
    )
    return [
        Sample(m, k[:255], node, t, v) for m, k, t, v in rows.select("site_metric", "key", "t_ms", "value").iter_rows()
    ]


def _where_heartbeats_are_silent(workload_id: int, samples: list[Sample]) -> list[Sample]:
    """Samples far from every point already stored for their series: an archive fills what live heartbeats
    missed (a job without a site connection, a heartbeat lost) and never doubles what they drew. The agent's
    clock and the site's may put the same measurement one slot apart, hence "far" = more than one slot."""
    import numpy as np

    if not samples:
        return samples
    ids = _series_ids(workload_id, samples)
    lo = min(s.t_ms for s in samples) - RAW_STEP_S * 1000
    hi = max(s.t_ms for s in samples) + RAW_STEP_S * 1000
    stored: dict[int, list[int]] = defaultdict(list)
    for series_id, t_ms in (
        Point.objects.filter(series_id__in=set(ids.values()), t_ms__gte=lo, t_ms__lte=hi)
        .order_by("series_id", "t_ms")
        .values_list("series_id", "t_ms")
    ):
        stored[series_id].append(t_ms)
    by_series: dict[int, list[Sample]] = defaultdict(list)
    for sample in samples:
        by_series[ids[(sample.metric, sample.key)]].append(sample)
    out: list[Sample] = []
    for series_id, mine in by_series.items():
        times = np.asarray(stored.get(series_id, []), np.int64)
        if not len(times):
            out.extend(mine)
            continue
        t = np.asarray([s.t_ms for s in mine], np.int64)
        at = np.clip(np.searchsorted(times, t), 1, len(times)) - 1
        nearest = np.minimum(np.abs(times[at] - t), np.abs(times[np.minimum(at + 1, len(times) - 1)] - t))
        out.extend(s for s, far in zip(mine, nearest > RAW_STEP_S * 1000, strict=True) if far)
    return out


def archive_device_samples_record(archive: Archive) -> list[Sample]:
    """Record the device and NIC samples an ingested archive carried (where heartbeats left gaps)."""
    import pyarrow.parquet as pq

    from apps.workloads.ingest import SAMPLES_SUFFIX, samples_prefix
    from comminsight_site.objectstore import object_store

    store = object_store()
    samples: list[Sample] = []
    for location in store.list(f"{samples_prefix(archive.workload_id, archive.node)}/{archive.sha256}", SAMPLES_SUFFIX):
        with store.open_input(location) as handle:
            samples.extend(archive_device_samples(pq.read_table(handle), archive.node))
    return _where_heartbeats_are_silent(archive.workload_id, samples)


def archive_summaries_record(archive_id: int) -> int:
    """Step times, communicator throughput and device/NIC counters from one ingested archive's node; return
    the new points."""
    archive = Archive.objects.filter(pk=archive_id, state=ArchiveState.INGESTED).first()
    if archive is None or archive.workload_id is None:
        return 0
    samples = archive_device_samples_record(archive)
    added = points_record(archive.workload_id, samples) + _archive_operations_record(archive)
    if samples:
        workload_id = archive.workload_id
        transaction.on_commit(lambda: publish_points(workload_id, sorted({s.metric for s in samples})))
    return added


def _archive_operations_record(archive: Archive) -> int:
    """Step times and communicator throughput from the operations of one ingested archive's node."""
    import polars as pl
    import pyarrow.dataset as ds

    from apps.workloads.ingest import path_part, store_prefix
    from comminsight.formats.operations import ROWS_SCHEMA, finish
    from comminsight_site.objectstore import object_store

    if archive.first_ns is None or archive.last_ns is None:
        return 0
    store = object_store()
    files = store.list(f"{store_prefix(archive.workload_id)}/node-{path_part(archive.node)}", suffix=".parquet")
    if not files:
        return 0
    start = archive.first_ns - STEP_CONTEXT_NS
    end, begin = ds.field("end_ns"), ds.field("start_ns")  # either may be unknown (null) for a source
    window = (end.is_null() | (end >= start)) & (begin.is_null() | (begin <= archive.last_ns))
    table = finish(store.dataset(files, schema=ROWS_SCHEMA).to_table(filter=window))
    operations = pl.from_arrow(table)
    assert isinstance(operations, pl.DataFrame)
    try:
        samples = archive_samples(operations, archive.first_ns, archive.last_ns, archive.node)
    except (OperationalError, InterfaceError, OSError):
        raise
    except Exception:  # operations the analyses cannot summarise: the archive stays ingested, the charts wait
        logger.exception("archive %s: no monitoring summaries", archive.sha256[:12])
        return 0
    added = points_record(archive.workload_id, samples)
    logger.info("archive %s: %d monitoring points from %d operations", archive.sha256[:12], added, table.num_rows)
    if added:
        workload_id = archive.workload_id
        transaction.on_commit(lambda: publish_points(workload_id, sorted({s.metric for s in samples})))
    return added


# --- Bands across series (what a dashboard of many ranks draws) ------------------------------------------------


def bands_fill(workload_id: int, metric: str, width_s: int, start_ms: int, end_ms: int) -> int:
    """Compute and store the bands of ``width_s`` buckets in ``start_ms``..``end_ms`` from the rollups."""
    from .selectors import band_from_rollups

    rows = band_from_rollups(workload_id, metric, width_s, start_ms, end_ms)
    Band.objects.bulk_create(
        [
            Band(
                workload_id=workload_id,
                metric=metric,
                width_s=width_s,
                bucket_ms=b,
                series=n,
                low=lo,
                median=med,
                high=hi,
            )
            for b, lo, med, hi, n in rows
        ],
        update_conflicts=True,
        unique_fields=["workload", "metric", "width_s", "bucket_ms"],
        update_fields=["series", "low", "median", "high"],
        batch_size=2000,
    )
    return len(rows)


def _banded_metrics(workload_id: int) -> list[str]:
    from .selectors import MAX_LINES

    counts = Series.objects.filter(workload_id=workload_id).values("metric").annotate(n=Count("id"))
    return sorted(row["metric"] for row in counts if row["n"] > MAX_LINES)


def bands_materialize(now: datetime | None = None) -> int:
    """Store the bands of closed buckets of the last hours that are not stored yet, for every workload heard
    from recently (the periodic task); return the buckets written."""
    from .selectors import _spans

    now = now or timezone.now()
    now_ms = int(now.timestamp() * 1000)
    recent = now - timedelta(seconds=BAND_LOOKBACK_S)
    workloads = Workload.objects.filter(_active_since(recent)).values_list("pk", flat=True)
    written = 0
    for workload_id in workloads:
        for metric in _banded_metrics(workload_id):
            for width in ROLLUP_WIDTHS_S:
                w = width * 1000
                start = ((now_ms - BAND_LOOKBACK_S * 1000) // w) * w
                closed_end = ((now_ms - BAND_GRACE_S * 1000) // w) * w  # buckets ending before it are closed
                stored = set(
                    Band.objects.filter(
                        workload_id=workload_id,
                        metric=metric,
                        width_s=width,
                        bucket_ms__gte=start,
                        bucket_ms__lt=closed_end,
                    ).values_list("bucket_ms", flat=True)
                )
                for a, z in _spans([b for b in range(start, closed_end - w + 1, w) if b not in stored], w):
                    written += bands_fill(workload_id, metric, width, a, z)
    return written


def _active_since(since: datetime) -> Q:
    return Q(status__in=[WorkloadStatus.RUNNING, WorkloadStatus.HUNG]) | Q(last_seen_at__gte=since)


def bands_rebuild(workload_id: int) -> int:
    """Recompute every band of ``workload_id`` from its rollups (after ``rollups_rebuild``)."""
    written = 0
    Band.objects.filter(workload_id=workload_id).delete()
    for metric in _banded_metrics(workload_id):
        for width in ROLLUP_WIDTHS_S:
            edges = Rollup.objects.filter(
                series__workload_id=workload_id, series__metric=metric, width_s=width
            ).aggregate(lo=Min("bucket_ms"), hi=Max("bucket_ms"))
            if edges["lo"] is not None:
                written += bands_fill(workload_id, metric, width, edges["lo"], edges["hi"] + width * 1000)
    return written


# --- Retention and live updates -----------------------------------------------------------------------------------


def points_purge(now: datetime | None = None) -> dict[str, int]:
    """Delete points and rollups older than ``MONITORING_RETENTION_DAYS``, and series left empty."""
    cutoff = now or timezone.now()
    cutoff_ms = int((cutoff - timedelta(days=settings.MONITORING_RETENTION_DAYS)).timestamp() * 1000)
    points, _ = Point.objects.filter(t_ms__lt=cutoff_ms).delete()
    # A rollup bucket goes once it has ended before the cutoff (its points are gone too).
    rollups = 0
    for width in ROLLUP_WIDTHS_S:
        deleted, _ = Rollup.objects.filter(width_s=width, bucket_ms__lt=cutoff_ms - width * 1000).delete()
        rollups += deleted
    for width in ROLLUP_WIDTHS_S:
        deleted, _ = Band.objects.filter(width_s=width, bucket_ms__lt=cutoff_ms - width * 1000).delete()
        rollups += deleted
    empty = Series.objects.filter(
        ~Exists(Rollup.objects.filter(series=OuterRef("pk"))), ~Exists(Point.objects.filter(series=OuterRef("pk")))
    )
    series, _ = empty.delete()
    counts = {"points": points, "rollups": rollups, "series": series}
    if any(counts.values()):
        logger.info("monitoring purge (older than %g days): %s", settings.MONITORING_RETENTION_DAYS, counts)
    return counts


def monitoring_group(workload_id: int) -> str:
    """Channels group of a workload's dashboards (``ws/monitoring/workloads/<id>/``)."""
    return f"monitoring-workload-{workload_id}"


def publish_points(workload_id: int, metrics: list[str]) -> None:
    """Tell open dashboards that new points arrived (they fetch the chart again); never fails the caller."""
    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(
            monitoring_group(workload_id),
            {"type": "monitoring.points", "metrics": [m for m in metrics if m in METRICS]},
        )
    except Exception:  # a broken channel layer must not lose the points
        logger.exception("could not publish new points of workload %s", workload_id)
