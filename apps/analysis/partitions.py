"""Partitioned analysis runs: a job's work split over its store's partitions, as one Celery chord.

The operations store is partitioned by workload / node / rank (one Parquet object per archive per
rank, ``apps.workloads.ingest``), and within a rank by time window (an archive covers one window
of a node's recording). Each partitioned analysis says which partitions it needs:

- **hang** — whole ranks: consecutive ranks of the store listing, up to ``ANALYSIS_PARTITION_ROWS``
  rows (Parquet footers) each; a map task keeps the tail of every communicator
  (``comminsight.analysis.partitioned.hang_tail``). Its rows are finished by the record decoder
  (``comminsight.formats.operations.finish``) with the communicator members of the whole store,
  found once when the run is planned, so P2P peers on ranks of other partitions map as they do in
  ``load_operations``.
- **perf** — whole communicators (operations are matched across their members): communicators
  packed up to ``ANALYSIS_PARTITION_ROWS`` rows, counted by one streamed pass over the store's
  ``comm_id`` column, file by file; a map task reads its communicators' rows from the files that
  hold any (its members' ranks; a filtered scan of those) and returns
  per-communicator medians and per-transfer samples.

``partitioned_start`` (called by the job's task once it holds a concurrency slot) writes the plan to
the object store and queues the chord: one ``map_partition`` task per partition, on any worker,
then ``reduce_partitions``. Tasks carry (job id, attempt, partition index); summaries go to the
object store under ``analysis-runs/job-<id>/attempt-<n>/``, never into the broker. The job stays
*running* for the whole chord, so the shared concurrency limit counts it once; each finished map
task advances ``partitions_done`` and is published over Channels. A failing map task is retried
on its own (its summary is simply written again); a run that was cancelled, failed or superseded
by a newer attempt is ignored by its remaining tasks.
"""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from django.conf import settings
from django.db.models import F
from django.utils import timezone

from apps.workloads.ingest import workload_metadata_dir
from apps.workloads.names import operations_named
from comminsight.evidence.schema import SCHEMA
from comminsight.formats.operations import PEER_IN_COMM, ROWS_SCHEMA, communicator_members, finish, resolve_peers
from comminsight_site.objectstore import object_store

from .models import AnalysisJob, AnalysisKind, JobState

logger = logging.getLogger(__name__)

PARTITIONED_KINDS = (AnalysisKind.HANG, AnalysisKind.PERF)
PERF_COLUMNS = [
    "rank",
    "comm_id",
    "comm_size",
    "op",
    "is_p2p",
    "seq",
    "peer",
    "bytes",
    "start_ns",
    "end_ns",
    "enqueue_ns",
]
_RANK_DIR = re.compile(r"/rank-(-?\d+)/[^/]+$")


def runs_prefix(job_id: int) -> str:
    return f"analysis-runs/job-{job_id}"


def _run_prefix(job_id: int, attempt: int) -> str:
    return f"{runs_prefix(job_id)}/attempt-{attempt}"


@dataclass(frozen=True)
class Partition:
    files: list[int]  # indices into the store listing, in its order
    comm_ids: list[str] | None = None  # perf: the communicators it holds (None: every row of the files)


# --- Planning --------------------------------------------------------------------------------------------------


def _file_rows(location: str) -> int:
    with object_store().open_input(location) as handle:
        return pq.ParquetFile(handle).metadata.num_rows


def rank_partitions(files: list[str], max_rows: int) -> list[Partition]:
    """Consecutive whole ranks of the listing, up to ``max_rows`` rows per partition (a larger rank alone)."""
    by_rank: dict[str, list[int]] = {}
    for i, location in enumerate(files):
        found = _RANK_DIR.search(location)
        by_rank.setdefault(found.group(1) if found else "", []).append(i)
    partitions: list[Partition] = []
    current: list[int] = []
    rows = 0
    for rank_files in by_rank.values():  # first appearance in the listing
        n = sum(_file_rows(files[i]) for i in rank_files)
        if current and rows + n > max_rows:
            partitions.append(Partition(sorted(current)))
            current, rows = [], 0
        current = current + rank_files
        rows += n
    if current:
        partitions.append(Partition(sorted(current)))
    return partitions


def communicator_partitions(files: list[str], max_rows: int) -> list[Partition]:
    """Whole communicators packed up to ``max_rows`` rows; each partition lists only the files that hold its
    communicators' rows (its members' ranks), found by one pass over the store's ``comm_id`` column, file by file."""
    counts: dict[str, int] = {}
    holders: dict[str, set[int]] = {}
    dataset = object_store().dataset(files, schema=SCHEMA)
    for index, fragment in enumerate(dataset.get_fragments()):  # in the order of ``files``
        for batch in fragment.to_batches(columns=["comm_id"], batch_size=1 << 20):
            values = pc.value_counts(batch.column(0))
            for value, count in zip(values.field(0).to_pylist(), values.field(1).to_pylist(), strict=True):
                counts[value] = counts.get(value, 0) + count
                holders.setdefault(value, set()).add(index)
    partitions: list[Partition] = []
    current: list[str] = []
    rows = 0

    def close() -> None:
        partitions.append(Partition(sorted(set().union(*(holders[c] for c in current))), list(current)))

    for comm_id in sorted(counts):
        if current and rows + counts[comm_id] > max_rows:
            close()
            current, rows = [], 0
        current.append(comm_id)
        rows += counts[comm_id]
    if current:
        close()
    return partitions


def store_communicator_members(files: list[str]) -> pa.Table:
    """Which global rank holds each communicator rank, over the whole store (three columns, streamed)."""
    columns = ["comm_id", "comm_rank", "rank"]
    if not files:
        return SCHEMA.empty_table().select(columns)
    scanner = object_store().dataset(files, schema=SCHEMA).scanner(columns=columns, batch_size=1 << 20)
    parts = [communicator_members(pa.Table.from_batches([batch])) for batch in scanner.to_batches()]
    return communicator_members(pa.concat_tables(parts)) if parts else SCHEMA.empty_table().select(columns)


def plan_partitions(kind: str, files: list[str]) -> list[Partition]:
    max_rows = settings.ANALYSIS_PARTITION_ROWS
    if not files:
        return [Partition([])]  # one empty partition: the reduce says what the analysis says of no data
    if kind == AnalysisKind.PERF:
        return communicator_partitions(files, max_rows) or [Partition([])]
    return rank_partitions(files, max_rows)


def partitioned_start(job: AnalysisJob, files: list[str], fingerprint: str) -> int:
    """Plan ``job``'s partitions (its current attempt) and record how many; return the count."""
    partitions = plan_partitions(job.kind, files)
    plan = {
        "fingerprint": fingerprint,
        "files": files,
        "partitions": [{"files": p.files, "comm_ids": p.comm_ids} for p in partitions],
    }
    store = object_store()
    store.delete_prefix(runs_prefix(job.pk))  # summaries of earlier attempts
    if job.kind == AnalysisKind.HANG:
        # A rank partition lacks the other ranks' rows that say who holds a P2P peer: one pass over the store.
        members = pl.from_arrow(store_communicator_members(files))
        assert isinstance(members, pl.DataFrame)
        _write_frame(f"{_run_prefix(job.pk, job.attempts)}/members.parquet", members)
    store.write_bytes(f"{_run_prefix(job.pk, job.attempts)}/plan.json", json.dumps(plan).encode())
    AnalysisJob.objects.filter(pk=job.pk).update(partitions=len(partitions), partitions_done=0)
    job.partitions, job.partitions_done = len(partitions), 0
    return len(partitions)


# --- Map and reduce --------------------------------------------------------------------------------------------


def _current(job_id: int, attempt: int) -> AnalysisJob | None:
    """The job while this attempt is its running one; None when it was cancelled, failed or superseded."""
    job = AnalysisJob.objects.select_related("workload").filter(pk=job_id).first()
    if job is None or job.state != JobState.RUNNING or job.attempts != attempt:
        return None
    return job


def _plan(job_id: int, attempt: int) -> dict[str, Any]:
    store = object_store()
    return json.loads(store.read_bytes(store.location(f"{_run_prefix(job_id, attempt)}/plan.json")))


def _write_frame(key: str, frame: pl.DataFrame) -> None:
    buffer = io.BytesIO()
    frame.write_parquet(buffer, compression="zstd")
    object_store().write_bytes(key, buffer.getvalue())


def _read_frame(key: str) -> pl.DataFrame:
    store = object_store()
    return pl.read_parquet(io.BytesIO(store.read_bytes(store.location(key))))


def partition_map(job_id: int, attempt: int, index: int) -> bool:
    """Summarise partition ``index`` of the job's run ``attempt`` into the object store; False: nothing to do
    (the run is over). Idempotent: a retry writes the same summary again."""
    from comminsight.analysis.partitioned import hang_tail, perf_map

    job = _current(job_id, attempt)
    if job is None:
        return False
    plan = _plan(job_id, attempt)
    spec = plan["partitions"][index]
    files, comm_ids = [plan["files"][i] for i in spec["files"]], spec["comm_ids"]
    prefix = f"{_run_prefix(job_id, attempt)}/part-{index:06d}"
    if job.kind == AnalysisKind.PERF:
        # Whole communicators: their own rows say who holds each P2P peer.
        table = resolve_peers(_read(files, comm_ids, [*PERF_COLUMNS, "comm_rank", PEER_IN_COMM])).select(PERF_COLUMNS)
        summary = perf_map(table)
        if summary is not None:
            _write_frame(f"{prefix}-groups.parquet", summary[0])
            _write_frame(f"{prefix}-samples.parquet", summary[1])
    else:
        members = _read_frame(f"{_run_prefix(job_id, attempt)}/members.parquet").to_arrow()
        _write_frame(f"{prefix}-tail.parquet", hang_tail(finish(_read(files, None, None), members)))
    AnalysisJob.objects.filter(pk=job_id, attempts=attempt).update(
        partitions_done=F("partitions_done") + 1, updated_at=timezone.now()
    )
    return True


def _read(files: list[str], comm_ids: list[str] | None, columns: list[str] | None) -> pa.Table:
    """The decoder's stored rows of ``files`` (``peer_in_comm`` included; resolve_peers/finish map it)."""
    if not files:
        return ROWS_SCHEMA.empty_table() if columns is None else ROWS_SCHEMA.empty_table().select(columns)
    dataset = object_store().dataset(files, schema=ROWS_SCHEMA)
    where = pc.field("comm_id").isin(comm_ids) if comm_ids is not None else None
    return dataset.to_table(columns=columns, filter=where)


def _samples_by_rank(locations: list[str]) -> Iterator[pl.DataFrame]:
    """Every partition's perf samples, a range of ranks at a time (about ``ANALYSIS_PARTITION_ROWS`` rows each):
    the ranges come from the files' Parquet statistics, each is read with a filter on ``rank``."""
    if not locations:
        return
    store = object_store()
    low, high, rows = None, None, 0
    for location in locations:
        with store.open_input(location) as handle:
            meta = pq.ParquetFile(handle).metadata
        rows += meta.num_rows
        column = meta.schema.names.index("rank")
        for g in range(meta.num_row_groups):
            stats = meta.row_group(g).column(column).statistics
            if stats is None or not stats.has_min_max:
                low, high = None, None  # no statistics: one chunk of everything
                break
            low = stats.min if low is None else min(low, stats.min)
            high = stats.max if high is None else max(high, stats.max)
        else:
            continue
        break
    dataset = store.dataset(locations)
    if low is None or high is None or rows == 0:
        yield pl.from_arrow(dataset.to_table())  # type: ignore[misc]
        return
    span = high - low + 1
    width = max(1, settings.ANALYSIS_PARTITION_ROWS * span // rows)
    for start in range(low, high + 1, width):
        where = (pc.field("rank") >= start) & (pc.field("rank") < start + width)
        chunk = pl.from_arrow(dataset.to_table(filter=where))
        assert isinstance(chunk, pl.DataFrame)
        yield chunk


def partition_reduce(job_id: int, attempt: int) -> dict[str, Any] | None:
    """Merge the run's summaries into the job's report; None when the run is over (cancelled, failed, stale)."""
    from comminsight.analysis.partitioned import hang_reduce, perf_reduce_by_rank

    job = _current(job_id, attempt)
    if job is None:
        return None
    count = len(_plan(job_id, attempt)["partitions"])
    prefix = _run_prefix(job_id, attempt)
    store = object_store()
    present = set(store.list(prefix, suffix=".parquet"))
    params = dict(job.parameters)
    if job.kind == AnalysisKind.PERF:
        done = [i for i in range(count) if store.location(f"{prefix}/part-{i:06d}-groups.parquet") in present]
        groups = [_read_frame(f"{prefix}/part-{i:06d}-groups.parquet") for i in done]
        samples = [store.location(f"{prefix}/part-{i:06d}-samples.parquet") for i in done]
        return perf_reduce_by_rank(groups, _samples_by_rank(samples), slow_fraction=params["slow_fraction"])
    tails = [_read_frame(f"{prefix}/part-{i:06d}-tail.parquet") for i in range(count)]
    merged = pa.concat_tables([t.to_arrow().cast(SCHEMA) for t in tails if t.height] or [SCHEMA.empty_table()])
    with workload_metadata_dir(job.workload) as tables:
        named = pl.from_arrow(operations_named(merged, tables))
    assert isinstance(named, pl.DataFrame)
    return hang_reduce([named], silence_s=params["silence_s"])


def run_fingerprint(job_id: int, attempt: int) -> str:
    return str(_plan(job_id, attempt)["fingerprint"])


def run_cleanup(job_id: int, attempt: int) -> None:
    object_store().delete_prefix(_run_prefix(job_id, attempt))
