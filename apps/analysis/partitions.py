"""Partitioned analysis runs: a job's work split over its store's partitions, as one Celery chord.

The operations store is partitioned by workload / node / rank (one Parquet object per archive per
rank, ``apps.workloads.ingest``), and within a rank by time window (an archive covers one window
of a node's recording). Each partitioned analysis says which partitions it needs:

- **hang** — whole ranks: consecutive ranks of the store listing, up to ``ANALYSIS_PARTITION_ROWS``
  rows (Parquet footers) each; a map task keeps the tail of every communicator
  (``comminsight.analysis.partitioned.hang_tail``), and the reduce folds the tails one at a time
  (``hang_merge``: two passes, memory no longer following the job's size). Its rows are finished by the record decoder
  (``comminsight.formats.operations.finish``) with the communicator members of the whole store,
  found once when the run is planned, so P2P peers on ranks of other partitions map as they do in
  ``load_operations``.
- **perf** — whole communicators (operations are matched across their members): communicators
  packed up to ``ANALYSIS_PARTITION_ROWS`` rows, counted by one streamed pass over the store's
  ``comm_id`` column, file by file; a map task reads its communicators' rows from the files that
  hold any (its members' ranks; a filtered scan of those) and returns
  per-communicator medians and per-transfer samples. A communicator of more rows is cut into slices of its
  sequence numbers (``Partition.seq_range``), planned from a second pass counting its rows per range of
  sequence numbers; the merge takes a sliced communicator's medians over its slices exactly.

- **steps** — whole ranks, as hang, in two stages (``comminsight.analysis.partitioned``): stage 1's map
  tasks return what their ranks tell the others (communicator roles, the collective instances they
  saw, their point-to-point rows) and its reduce merges that into the job's roles and every event's
  waiting (``links``); stage 2's map tasks run the step engine over their ranks with those, and the
  last reduce merges their per-step totals, one partition at a time, into the report of the whole table
  (with the per-(rank, step) rows only when it keeps per-rank details: up to ``MAX_STEP_RANK_DETAILS``).

- **stragglers** — windows of whole steps (``comminsight.analysis.stragglers``): planning goes through the store
  twice, a batch of whole ranks at a time (``comminsight.analysis.straggler_plan``: the steps, the job's facts and
  the preparation's plan the whole table gives, from per-batch summaries and scratch objects of the run, never the
  whole table; the store is laid out by rank, not by step) and writes each window's rows, up to
  ``ANALYSIS_PARTITION_ROWS`` of whole steps that no collective or send/receive pair crosses, as an object of the
  run, a batch's rows at a time; a map task prepares its window
  (matching, the statistics' sums, the replay's columns); the reduce merges the windows in order and runs the
  replay and the culprit decision (``report_from_windows``), equal to the whole-table report.

``partitioned_start`` (called by the job's task once it holds a concurrency slot) writes the plan to
the object store and queues the chord: one ``map_partition`` task per partition, on any worker, then
``reduce_partitions`` (which queues the next stage's chord, if any). Tasks carry (job id, attempt,
partition index, stage); summaries go to the object store under ``analysis-runs/job-<id>/attempt-<n>/``,
never into the broker. The job stays *running* for the whole run (every stage), so the shared
concurrency limit counts it once; each finished map task advances ``partitions_done`` (out of
``partitions``: the map tasks of every stage) and is published over Channels. A failing map task is
retried on its own (its summary is simply written again); a run that was cancelled, failed or superseded
by a newer attempt is ignored by its remaining tasks.
"""

from __future__ import annotations

import io
import json
import logging
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
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

PARTITIONED_KINDS = (AnalysisKind.HANG, AnalysisKind.PERF, AnalysisKind.STEPS, AnalysisKind.STRAGGLERS)
STAGES = {AnalysisKind.STEPS: 2}  # chords in a row (1 when not listed)
RANK_PARTITIONED = (AnalysisKind.HANG, AnalysisKind.STEPS)  # whole ranks: their rows need the store's members
NO_OPERATIONS = "no operations have been ingested for this workload yet"
READ_FILES = 256  # files read through one Arrow dataset at a time (``_read``)
MAX_STEP_RANK_DETAILS = 200_000  # step x rank objects kept in a stored steps result; beyond, summaries only
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
    # perf: a slice [from, to) of one communicator's sequence numbers (None: unbounded), ``comm_ids`` its one
    # communicator; the first slice also holds its rows without a sequence number and its point-to-point rows
    seq_range: list[int | None] | None = None


# --- Planning --------------------------------------------------------------------------------------------------


def _file_rows(location: str) -> int:
    with object_store().open_input(location) as handle:
        return pq.ParquetFile(handle).metadata.num_rows


def rank_partitions(files: list[str], max_rows: int, by_rank_number: bool = False) -> list[Partition]:
    """Consecutive whole ranks of the listing, up to ``max_rows`` rows per partition (a larger rank alone);
    ``by_rank_number``: ranks in numeric order (the whole table's, ``finish`` sorts by rank), not the listing's."""
    by_rank: dict[str, list[int]] = {}
    for i, location in enumerate(files):
        found = _RANK_DIR.search(location)
        by_rank.setdefault(found.group(1) if found else "", []).append(i)
    ranks = list(by_rank)  # first appearance in the listing
    if by_rank_number:
        ranks.sort(key=lambda r: int(r) if r else -1)
    partitions: list[Partition] = []
    current: list[int] = []
    rows = 0
    for rank_files in (by_rank[r] for r in ranks):
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
    communicators' rows (its members' ranks), found by one pass over the store's ``comm_id`` and ``seq`` columns,
    file by file. A communicator of more rows is cut into slices of sequence numbers (``seq_slices``), planned
    from a second pass counting its rows per range of sequence numbers."""
    from comminsight.analysis.partitioned import seq_bucket, seq_bucket_width, seq_slices

    counts: dict[str, int] = {}
    spans: dict[str, tuple[int, int]] = {}
    holders: dict[str, set[int]] = {}
    dataset = object_store().dataset(files, schema=SCHEMA)
    for index, fragment in enumerate(dataset.get_fragments()):  # in the order of ``files``
        for batch in fragment.to_batches(columns=["comm_id", "seq"], batch_size=1 << 20):
            found = pl.from_arrow(batch)
            assert isinstance(found, pl.DataFrame)
            per_comm = found.group_by("comm_id").agg(pl.len(), low=pl.col("seq").min(), high=pl.col("seq").max())
            for comm_id, count, low, high in per_comm.iter_rows():
                counts[comm_id] = counts.get(comm_id, 0) + count
                holders.setdefault(comm_id, set()).add(index)
                if low is not None:
                    known = spans.get(comm_id, (low, high))
                    spans[comm_id] = (min(known[0], low), max(known[1], high))
    large = sorted(c for c, n in counts.items() if n > max_rows)
    widths = {c: seq_bucket_width(*spans.get(c, (0, 0))) for c in large}
    rows: dict[str, dict[int, int]] = {c: {} for c in large}
    if large:  # their rows per range of sequence numbers (second pass, over the files holding them)
        holding = sorted(set().union(*(holders[c] for c in large)))
        columns = ["comm_id", "seq", "is_p2p"]
        where = pc.field("comm_id").isin(large)
        for batch in (
            object_store()
            .dataset([files[i] for i in holding], schema=SCHEMA)
            .to_batches(columns=columns, filter=where, batch_size=1 << 20)
        ):
            found = pl.from_arrow(batch)
            assert isinstance(found, pl.DataFrame)
            for (comm_id,), part in found.partition_by("comm_id", as_dict=True).items():
                low = spans.get(comm_id, (0, 0))[0]
                ranges = part.select(bucket=seq_bucket(low, widths[comm_id])).get_column("bucket").value_counts()
                for bucket, count in ranges.iter_rows():
                    rows[comm_id][bucket] = rows[comm_id].get(bucket, 0) + count
    partitions: list[Partition] = []
    current: list[str] = []
    held = 0

    def close() -> None:
        partitions.append(Partition(sorted(set().union(*(holders[c] for c in current))), list(current)))

    for comm_id in sorted(counts):
        if comm_id in rows:  # a communicator in slices, each a partition of its own
            low = spans.get(comm_id, (0, 0))[0]
            for piece in seq_slices(rows[comm_id], low, widths[comm_id], max_rows):
                partitions.append(Partition(sorted(holders[comm_id]), [comm_id], list(piece)))
            continue
        if current and held + counts[comm_id] > max_rows:
            close()
            current, held = [], 0
        current.append(comm_id)
        held += counts[comm_id]
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


def stages(kind: str) -> int:
    return STAGES.get(kind, 1)


def partitioned_start(job: AnalysisJob, files: list[str], fingerprint: str) -> int:
    """Plan ``job``'s partitions (its current attempt) and record how many map tasks it runs; return the
    partitions per stage."""
    store = object_store()
    store.delete_prefix(runs_prefix(job.pk))  # summaries of earlier attempts
    if job.kind == AnalysisKind.STRAGGLERS:
        windows = _stragglers_start(job, files, _run_prefix(job.pk, job.attempts))
        partitions = [Partition([]) for _ in range(windows)]
    else:
        partitions = plan_partitions(job.kind, files)
    plan = {
        "fingerprint": fingerprint,
        "files": files,
        "partitions": [{"files": p.files, "comm_ids": p.comm_ids, "seq_range": p.seq_range} for p in partitions],
    }
    if job.kind in RANK_PARTITIONED:
        # A rank partition lacks the other ranks' rows that say who holds a P2P peer: one pass over the store.
        members = pl.from_arrow(store_communicator_members(files))
        assert isinstance(members, pl.DataFrame)
        _write_frame(f"{_run_prefix(job.pk, job.attempts)}/members.parquet", members)
    store.write_bytes(f"{_run_prefix(job.pk, job.attempts)}/plan.json", json.dumps(plan).encode())
    tasks = len(partitions) * stages(job.kind)
    AnalysisJob.objects.filter(pk=job.pk).update(partitions=tasks, partitions_done=0)
    job.partitions, job.partitions_done = tasks, 0
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


def _write_frame(key: str, frame: pl.DataFrame, row_group_size: int | None = None) -> None:
    buffer = io.BytesIO()
    frame.write_parquet(buffer, compression="zstd", row_group_size=row_group_size)
    object_store().write_bytes(key, buffer.getvalue())


def _read_frame(key: str) -> pl.DataFrame:
    store = object_store()
    return pl.read_parquet(io.BytesIO(store.read_bytes(store.location(key))))


def _rank_rows(job: AnalysisJob, files: list[str], attempt: int) -> pa.Table:
    """A partition of whole ranks as the whole-table run reads them: decoded with the store's members, named."""
    members = _read_frame(f"{_run_prefix(job.pk, attempt)}/members.parquet").to_arrow()
    rows = finish(_read(files, None, None), members)
    if job.kind == AnalysisKind.HANG:
        return rows  # the reduce names the tails
    with workload_metadata_dir(job.workload) as tables:
        return operations_named(rows, tables)


def partition_map(job_id: int, attempt: int, index: int, stage: int = 1) -> bool:
    """Summarise partition ``index`` for ``stage`` of the job's run ``attempt`` into the object store; False:
    nothing to do (the run is over). Idempotent: a retry writes the same summary again."""
    from comminsight.analysis.partitioned import hang_tail, perf_map, perf_slice_map

    job = _current(job_id, attempt)
    if job is None:
        return False
    plan = _plan(job_id, attempt)
    spec = plan["partitions"][index]
    files, comm_ids = [plan["files"][i] for i in spec["files"]], spec["comm_ids"]
    seq_range = spec.get("seq_range")
    prefix = f"{_run_prefix(job_id, attempt)}/part-{index:06d}"
    if job.kind == AnalysisKind.STEPS:
        _steps_map(job, attempt, index, stage, _rank_rows(job, files, attempt))
    elif job.kind == AnalysisKind.STRAGGLERS:
        _stragglers_map(job_id, attempt, index)
    elif job.kind == AnalysisKind.PERF:
        # Whole communicators (or a slice: its point-to-point rows are all in the first): their own rows say who
        # holds each P2P peer.
        columns = [*PERF_COLUMNS, "comm_rank", PEER_IN_COMM]
        table = resolve_peers(_read(files, comm_ids, columns, seq_range)).select(PERF_COLUMNS)
        if seq_range is None:
            summary = perf_map(table)
            names = ("groups", "samples")
        else:  # a slice's medians are taken over every slice by the merge
            summary = perf_slice_map(table)
            names = ("values", "samples")
        if summary is not None:
            _write_frame(f"{prefix}-{names[0]}.parquet", summary[0])
            _write_frame(f"{prefix}-{names[1]}.parquet", summary[1])
    else:
        _write_frame(f"{prefix}-tail.parquet", hang_tail(_rank_rows(job, files, attempt)))
    AnalysisJob.objects.filter(pk=job_id, attempts=attempt).update(
        partitions_done=F("partitions_done") + 1, updated_at=timezone.now()
    )
    return True


def _read(
    files: list[str], comm_ids: list[str] | None, columns: list[str] | None, seq_range: list | None = None
) -> pa.Table:
    """The decoder's stored rows of ``files`` (``peer_in_comm`` included; resolve_peers/finish map it): of the
    communicators ``comm_ids`` (None: all), of the slice ``seq_range`` of their sequence numbers (``Partition``)."""
    if not files:
        return ROWS_SCHEMA.empty_table() if columns is None else ROWS_SCHEMA.empty_table().select(columns)
    where = pc.field("comm_id").isin(comm_ids) if comm_ids is not None else None
    if seq_range is not None:
        where = where & _slice_rows(*seq_range)
    store = object_store()
    # A few hundred files per dataset: one keeps ~0.15 MiB per file it scanned until it is dropped (a slice of the
    # world communicator reads every rank's file: 4,096 files took 790 MiB in one dataset, 331 MiB by 256).
    parts = [
        store.dataset(files[i : i + READ_FILES], schema=ROWS_SCHEMA).to_table(columns=columns, filter=where)
        for i in range(0, len(files), READ_FILES)
    ]
    return pa.concat_tables(parts)


def _slice_rows(start: int | None, end: int | None) -> pc.Expression:
    """The rows of a slice of a communicator's sequence numbers, as ``seq_bucket`` places them (an Arrow dataset
    filter: ``comminsight.analysis.partitioned.slice_rows`` says the same of a polars frame)."""
    seq = pc.field("seq")
    collective = ~pc.field("is_p2p") & seq.is_valid()
    if start is not None:
        collective = collective & (seq >= start)
    if end is not None:
        collective = collective & (seq < end)
    if start is None:  # the first slice
        return collective | pc.field("is_p2p") | seq.is_null()
    return collective


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


def _steps_input(job: AnalysisJob, table: pa.Table) -> pl.DataFrame:
    df = pl.from_arrow(table)
    assert isinstance(df, pl.DataFrame)
    if job.parameters["ignore_labels"]:
        df = df.with_columns(step=pl.lit(None, dtype=pl.Int64))
    return df


def _steps_map(job: AnalysisJob, attempt: int, index: int, stage: int, table: pa.Table) -> None:
    """Stage 1: what this partition's ranks tell the others; stage 2: their steps, with the merged links."""
    from comminsight.analysis.partitioned import steps_evidence, steps_map

    run = _run_prefix(job.pk, attempt)
    prefix = f"{run}/part-{index:06d}"
    df = _steps_input(job, table)
    if stage == 1:
        evidence = steps_evidence(df)
        _write_frame(f"{prefix}-roles.parquet", evidence.role_rows)
        _write_frame(f"{prefix}-instances.parquet", evidence.instances)
        _write_frame(f"{prefix}-p2p.parquet", evidence.p2p)
        object_store().write_bytes(f"{prefix}-shape.json", json.dumps({"shape_alone": evidence.shape_alone}).encode())
        return
    store = object_store()
    links = json.loads(store.read_bytes(store.location(f"{run}/links.json")))
    # The job's instances of this partition's shared communicators (sorted by communicator: row groups skip).
    # The value set takes the stored column's type: an empty list would otherwise be typed null, which Arrow
    # refuses to compare with strings (a partition that shares no communicator).
    stored = store.dataset([store.location(f"{run}/instances.parquet")])
    shared_here = set(df.get_column("comm_id").drop_nulls().unique().to_list()) & set(links["shared"])
    comms = pa.array(sorted(shared_here), type=stored.schema.field("comm_id").type)
    instances = pl.from_arrow(stored.to_table(filter=pc.field("comm_id").isin(comms)))
    waits = pl.from_arrow(
        store.dataset([store.location(f"{run}/p2p-waits.parquet")]).to_table(filter=pc.field("part") == index)
    )
    assert isinstance(instances, pl.DataFrame)
    assert isinstance(waits, pl.DataFrame)
    use_templates = not job.parameters["period_only"]
    part = steps_map(
        df,
        links["roles"],
        instances,
        waits,
        links["shared"],
        use_templates=use_templates,
        shape_alone=links.get("shape_alone"),
    )
    _write_frame(f"{prefix}-steps.parquet", part.rank_steps)
    if part.label_counts is not None:
        _write_frame(f"{prefix}-labels.parquet", part.label_counts)
    methods = {str(rank): method for rank, method in part.methods.items()}
    store.write_bytes(f"{prefix}-methods.json", json.dumps(methods).encode())


def _write_stored(prefix: str, doc: dict[str, Any], frames: dict[str, pl.DataFrame]) -> None:
    """A JSON document and its frames under ``prefix`` (``<prefix>.json``, ``<prefix>-<name>.parquet``)."""
    for name, frame in frames.items():
        _write_frame(f"{prefix}-{name}.parquet", frame)
    object_store().write_bytes(f"{prefix}.json", json.dumps({**doc, "_frames": sorted(frames)}).encode())


def _read_stored(prefix: str) -> tuple[dict[str, Any], dict[str, pl.DataFrame]]:
    store = object_store()
    doc = json.loads(store.read_bytes(store.location(f"{prefix}.json")))
    return doc, {name: _read_frame(f"{prefix}-{name}.parquet") for name in doc.pop("_frames")}


class _RunScratch:
    """Planning's scratch objects of a stragglers run (``comminsight.analysis.straggler_plan.Scratch``), under
    ``<run>/plan/``: written between its passes, removed once the windows are written."""

    def __init__(self, run: str) -> None:
        self.prefix = f"{run}/plan"

    def write(self, key: str, frame: pl.DataFrame) -> None:
        from comminsight.analysis.straggler_plan import SCRATCH_ROW_GROUP

        _write_frame(f"{self.prefix}/{key}.parquet", frame, row_group_size=SCRATCH_ROW_GROUP)

    def read(self, keys: list[str], lo: int | None = None, hi: int | None = None) -> pl.DataFrame:
        store = object_store()
        where = None
        if lo is not None:
            where = pc.field("_step") >= lo
        if hi is not None:
            where = (pc.field("_step") <= hi) if where is None else where & (pc.field("_step") <= hi)
        locations = [store.location(f"{self.prefix}/{key}.parquet") for key in keys]
        parts = [  # row groups of other steps are skipped (the batches' rows are sorted by step)
            store.dataset(locations[i : i + READ_FILES]).to_table(filter=where)
            for i in range(0, len(locations), READ_FILES)
        ]
        frame = pl.from_arrow(pa.concat_tables(parts))
        assert isinstance(frame, pl.DataFrame)
        return frame


def _stragglers_start(job: AnalysisJob, files: list[str], run: str) -> int:
    """Plan a stragglers run (``comminsight.analysis.straggler_plan.plan_in_batches``: the ``prepare_table`` and
    ``plan_preparation`` of the whole table) over batches of whole ranks (``rank_partitions``, in rank order, up to
    ``ANALYSIS_PARTITION_ROWS`` rows and at most ``PLAN_BATCH_ROWS`` each, decoded with the store's communicator
    members as the whole table is),
    one batch held at a time; the job's facts and the preparation's plan are stored, and each window of whole steps
    (up to ``ANALYSIS_PARTITION_ROWS`` rows, never cut through a collective or a send/receive pair) is written as a
    Parquet object of the columns its map task reads (a store laid out by rank holds no step window: this
    re-partitions it). Returns the number of windows."""
    from comminsight.analysis.straggler_plan import PLAN_BATCH_ROWS, PLAN_COLUMNS, plan_in_batches, write_window

    batch_rows = min(settings.ANALYSIS_PARTITION_ROWS, PLAN_BATCH_ROWS)
    batches = rank_partitions(files, batch_rows, by_rank_number=True) if files else []
    if not batches or sum(_file_rows(files[i]) for b in batches for i in b.files) == 0:
        raise ValueError(NO_OPERATIONS)
    members = store_communicator_members(files)

    scratch = _RunScratch(run)
    with workload_metadata_dir(job.workload) as tables:

        def load(i: int) -> pl.DataFrame:
            # Every column read: ``finish`` puts the rows in canonical order, sorting by most of them.
            rows = operations_named(finish(_read([files[k] for k in batches[i].files], None, None), members), tables)
            frame = pl.from_arrow(rows.select([c for c in PLAN_COLUMNS if c in rows.column_names]))
            assert isinstance(frame, pl.DataFrame)
            return frame

        planned = plan_in_batches(
            len(batches),
            load,
            scratch,
            use_labels=not job.parameters["ignore_labels"],
            max_rows=settings.ANALYSIS_PARTITION_ROWS,
        )
    with tempfile.TemporaryDirectory(prefix="comminsight-window-") as local:
        for i in range(len(planned.plan.windows)):
            # A batch's rows at a time into a local file, then streamed to the store (a window of the whole job,
            # when the steps leave no boundary to cut at, is never held in memory).
            path = Path(local) / f"window-{i:06d}.parquet"
            write_window(scratch, planned, i, path)
            object_store().put_file(path, f"{run}/window-{i:06d}.parquet")
    object_store().delete_prefix(scratch.prefix)
    _write_stored(f"{run}/stragglers-plan", *planned.plan.to_stored())
    _write_stored(f"{run}/stragglers-facts", *planned.facts.to_stored())
    return len(planned.plan.windows)


def _stragglers_map(job_id: int, attempt: int, index: int) -> None:
    """A window of whole steps prepared (matching, the statistics' sums, the replay's columns), stored as frames."""
    from comminsight.analysis.stragglers import PreparationPlan, prepare_window

    run = _run_prefix(job_id, attempt)
    plan = PreparationPlan.from_stored(*_read_stored(f"{run}/stragglers-plan"))
    part = prepare_window(_read_frame(f"{run}/window-{index:06d}.parquet"), plan, index)
    for name, frame in part.to_frames().items():
        _write_frame(f"{run}/part-{index:06d}-{name}.parquet", frame)


def _stragglers_reduce(job_id: int, attempt: int, count: int, params: dict[str, Any]) -> dict[str, Any]:
    """The windows' parts, in window order, merged into the report of the whole table (``report_from_windows``)."""
    from comminsight.analysis.stragglers import JobFacts, PreparationPlan, WindowPart, report_from_windows

    run = _run_prefix(job_id, attempt)
    plan = PreparationPlan.from_stored(*_read_stored(f"{run}/stragglers-plan"))
    facts = JobFacts.from_stored(*_read_stored(f"{run}/stragglers-facts"))
    names = ("per", "late", "edges", "columns", "vocab", "meta")
    # Read one at a time as the merge reaches them (each window's replay columns are prepared and dropped before
    # the next is read), never every window's part at once.
    parts = (
        WindowPart.from_frames({name: _read_frame(f"{run}/part-{i:06d}-{name}.parquet") for name in names})
        for i in range(count)
    )
    return report_from_windows(facts, plan, parts, min_gain=params["min_gain"]).to_dict()


def partition_link(job_id: int, attempt: int) -> bool:
    """Stage 1's merge of a steps run: the job's roles, collective instances and point-to-point waiting, for
    stage 2's map tasks; False when the run is over. Raises ValueError when the store holds no operations."""
    from comminsight.analysis.partitioned import StepsEvidence, steps_links

    if _current(job_id, attempt) is None:
        return False
    count = len(_plan(job_id, attempt)["partitions"])
    run = _run_prefix(job_id, attempt)

    store = object_store()

    def evidence(i: int) -> StepsEvidence:  # read one partition at a time (twice): the merge folds as it goes
        shape = store.location(f"{run}/part-{i:06d}-shape.json")  # absent: stage 1 ran before it was recorded
        return StepsEvidence(
            _read_frame(f"{run}/part-{i:06d}-roles.parquet"),
            _read_frame(f"{run}/part-{i:06d}-instances.parquet"),
            _read_frame(f"{run}/part-{i:06d}-p2p.parquet"),
            json.loads(store.read_bytes(shape))["shape_alone"] if store.exists(shape) else None,
        )

    links = steps_links(count, evidence)
    if links.role_rows == 0:
        raise ValueError(NO_OPERATIONS)
    _write_frame(f"{run}/instances.parquet", links.instances)
    _write_frame(f"{run}/p2p-waits.parquet", links.p2p_waits)
    links_doc = {"roles": links.roles, "shared": links.shared, "shape_alone": links.shape_alone}
    object_store().write_bytes(f"{run}/links.json", json.dumps(links_doc).encode())
    return True


def step_summary(step: dict[str, Any]) -> dict[str, Any]:
    """Per-step aggregates over ranks from a step's per-rank details: for steps results stored before
    ``steps_document`` kept a ``summary`` with every step (new results compute it from ``step_totals``)."""
    ranks = step.get("ranks") or {}
    n = max(len(ranks), 1)
    return {
        "ranks": len(ranks),
        "comm_ms_mean": sum(sum((r.get("comm_ms") or {}).values()) for r in ranks.values()) / n,
        "exposed_wait_ms_mean": sum(r.get("exposed_wait_ms") or 0 for r in ranks.values()) / n,
        "slowest_rank": int(max(ranks, key=lambda r: ranks[r].get("duration_ms") or 0)) if ranks else None,
    }


def steps_document(report: Any, totals: pl.DataFrame | None = None) -> dict[str, Any]:
    """The stored steps result of a ``StepReport`` (whole-table and partitioned runs alike): per-step summaries
    computed from the per-(rank, step) totals (``totals``: ``step_totals`` of every rank, when the report holds no
    per-rank rows), with each step's per-rank details up to ``MAX_STEP_RANK_DETAILS`` step x rank objects."""
    from comminsight.analysis.partitioned import step_rows, step_totals

    totals = step_totals(report.rank_steps) if totals is None else totals
    detailed = int(totals.get_column("ranks").sum()) <= MAX_STEP_RANK_DETAILS
    steps = step_rows(totals)
    if detailed:  # a large job keeps per-step summaries, not steps x ranks objects
        ranks = {step["step"]: step["ranks"] for step in report.steps}
        steps = [{**step, "ranks": ranks[step["step"]]} for step in steps]
    doc: dict[str, Any] = {
        "method": report.method,
        "methods_by_rank": {str(k): v for k, v in sorted(report.methods_by_rank.items())},
        "steps": steps,
        "per_rank_details": detailed,
    }
    if report.agreement is not None:
        doc["agreement"] = report.agreement
    return doc


def _steps_reduce(job_id: int, attempt: int, count: int) -> dict[str, Any]:
    """The last merge of a steps run: one partition's summaries at a time; per-rank details only for a job of at
    most ``MAX_STEP_RANK_DETAILS`` (rank, step) rows (counted from the summaries' Parquet footers)."""
    from comminsight.analysis.partitioned import StepsPart, steps_merge

    store = object_store()
    run = _run_prefix(job_id, attempt)
    present = set(store.list(run, suffix=".parquet"))
    rows = 0
    for i in range(count):
        with store.open_input(store.location(f"{run}/part-{i:06d}-steps.parquet")) as handle:
            rows += pq.ParquetFile(handle).metadata.num_rows

    def parts() -> Iterator[StepsPart]:
        for i in range(count):
            prefix = f"{run}/part-{i:06d}"
            methods = json.loads(store.read_bytes(store.location(f"{prefix}-methods.json")))
            labels = f"{prefix}-labels.parquet"
            yield StepsPart(
                _read_frame(f"{prefix}-steps.parquet"),
                {int(rank): method for rank, method in methods.items()},
                _read_frame(labels) if store.location(labels) in present else None,
            )

    report, totals = steps_merge(parts(), per_rank=rows <= MAX_STEP_RANK_DETAILS)
    return steps_document(report, totals)


def partition_reduce(job_id: int, attempt: int) -> dict[str, Any] | None:
    """Merge the run's summaries into the job's report; None when the run is over (cancelled, failed, stale)."""
    from comminsight.analysis.hang import analyze_hang
    from comminsight.analysis.partitioned import hang_merge, perf_reduce_by_rank, slice_groups

    job = _current(job_id, attempt)
    if job is None:
        return None
    count = len(_plan(job_id, attempt)["partitions"])
    prefix = _run_prefix(job_id, attempt)
    store = object_store()
    present = set(store.list(prefix, suffix=".parquet"))
    params = dict(job.parameters)
    if job.kind == AnalysisKind.STEPS:
        return _steps_reduce(job_id, attempt, count)
    if job.kind == AnalysisKind.STRAGGLERS:
        return _stragglers_reduce(job_id, attempt, count, params)
    if job.kind == AnalysisKind.PERF:
        done = [i for i in range(count) if store.location(f"{prefix}/part-{i:06d}-groups.parquet") in present]
        groups = [_read_frame(f"{prefix}/part-{i:06d}-groups.parquet") for i in done]
        sliced = [i for i in range(count) if store.location(f"{prefix}/part-{i:06d}-values.parquet") in present]
        merged = slice_groups(len(sliced), lambda k: _read_frame(f"{prefix}/part-{sliced[k]:06d}-values.parquet"))
        groups += [merged] if merged is not None else []
        samples = [store.location(f"{prefix}/part-{i:06d}-samples.parquet") for i in sorted(done + sliced)]
        return perf_reduce_by_rank(groups, _samples_by_rank(samples), slow_fraction=params["slow_fraction"])
    # The tails folded one at a time (two passes over the stored summaries), then named and analysed.
    merged = hang_merge(count, lambda i: _read_frame(f"{prefix}/part-{i:06d}-tail.parquet"))
    with workload_metadata_dir(job.workload) as tables:
        typed = pa.schema([SCHEMA.field(name) for name in merged.columns])  # the tails keep some columns
        named = pl.from_arrow(operations_named(merged.to_arrow().cast(typed), tables))
    assert isinstance(named, pl.DataFrame)
    return analyze_hang(named, silence_s=params["silence_s"])


def run_fingerprint(job_id: int, attempt: int) -> str:
    return str(_plan(job_id, attempt)["fingerprint"])


def run_cleanup(job_id: int, attempt: int) -> None:
    object_store().delete_prefix(_run_prefix(job_id, attempt))
