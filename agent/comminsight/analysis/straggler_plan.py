"""Planning a windowed stragglers run over a job given as batches of whole ranks, one batch held at a time.

``prepare_table`` and ``plan_preparation`` (``comminsight.analysis.stragglers``) read the whole table; a store
laid out by rank gives the same facts, plan and windows from two passes over batches of whole ranks
(``plan_in_batches``), each batch read, summarised and dropped:

1. per batch: its ``coordinate_rows`` (a few rows per communicator and rank: roles, coordinates), the counts
   the job's facts need (timed rows and ranks, nulls and values of the coordinate and label columns), and its
   ranks' first coordinates. After the pass: whether the steps are labelled, the roles, the coordinates.
2. per batch: its steps (the labels, or the step engine over its ranks with the job's roles: the engine runs per
   rank), and what the plan needs of them: rows per step, per (rank, step) the replay's next start, the
   host-issue counts; its collective instances' step range (``instance_steps``) and its point-to-point rows,
   each written to the scratch store in buckets (by sequence number; by communicator, since a send pairs with a
   receive of its communicator); its rows in the windows' columns, sorted by step. After the pass, bucket by
   bucket: the instances and pairs spanning steps (``window_bounds`` never cuts them) and the pairs.

A window's rows are then read from the batches' sorted rows, a batch at a time (``window_parts``: a filter on the
step, row groups of other steps skipped; ``write_window`` writes them as they come). Held at once: a batch, a
bucket, and what is kept per rank and step (the coordinate rows, rows per step, the next starts, the pairs: two
integers per receive); never the job's rows.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, Protocol

import polars as pl
import pyarrow.parquet as pq

from comminsight.analysis.stragglers import (
    _WINDOW_COLUMNS,
    COMM_ROW,
    COORDS,
    NO_STEP,
    PREPARE_ROWS,
    TABLE_COLUMNS,
    TIMED,
    JobFacts,
    PreparationPlan,
    instance_steps,
    insufficient,
    next_starts,
    pair_spans,
    steps_from_starts,
    window_bounds,
)
from comminsight.semantic.matching import p2p_pairs
from comminsight.semantic.order import canonical_order
from comminsight.semantic.roles import coordinate_rows, infer_coordinates, infer_roles
from comminsight.semantic.steps import recover_steps

# The columns planning reads of a batch (``load`` may give only these): those the analysis reads of a table.
PLAN_COLUMNS = TABLE_COLUMNS
# Rows of a planning batch (whole ranks) and of a bucket at most. The peak follows the batch: ~0.9 KB per row of one
# batch (+926 MiB for one batch of 1,048,575 rows), +1,413 MiB for 16.8 M operations in batches of 1 Mi rows, +383
# MiB in batches of 128 Ki rows, no slower (bench/partitioned_analysis.py --plan-only, docs/operators.md).
PLAN_BATCH_ROWS = 1 << 18
SCRATCH_ROW_GROUP = 1 << 16  # rows per row group of a batch's sorted rows: a window's read skips other steps'
_LABELS = ("comm_desc", *COORDS)  # roles_from_shape_alone: none of these given means roles from shape alone


class Scratch(Protocol):
    """Where planning keeps what it wrote between passes (the site: the run's objects)."""

    def write(self, key: str, frame: pl.DataFrame) -> None: ...

    def read(self, keys: list[str], lo: int | None = None, hi: int | None = None) -> pl.DataFrame:
        """The frames of ``keys`` concatenated in order; with ``lo``/``hi``, only rows whose ``_step`` lies in
        [lo, hi] (None: unbounded)."""
        ...


class LocalScratch:
    """A ``Scratch`` in a local directory (Parquet files)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def write(self, key: str, frame: pl.DataFrame) -> None:
        frame.write_parquet(self.directory / f"{key}.parquet", row_group_size=SCRATCH_ROW_GROUP)

    def read(self, keys: list[str], lo: int | None = None, hi: int | None = None) -> pl.DataFrame:
        scan = pl.scan_parquet([self.directory / f"{key}.parquet" for key in keys])
        if lo is not None:
            scan = scan.filter(pl.col("_step") >= lo)
        if hi is not None:
            scan = scan.filter(pl.col("_step") <= hi)
        return scan.collect()


class BatchPlan:
    """A planned run: the job's facts, the preparation's plan, and where each batch's rows went."""

    def __init__(self, facts: JobFacts, plan: PreparationPlan, batches: list[str]) -> None:
        self.facts, self.plan, self.batches = facts, plan, batches


def _batch_key(i: int) -> str:
    return f"batch-{i:06d}"


def plan_in_batches(
    count: int,
    load: Callable[[int], pl.DataFrame],
    scratch: Scratch,
    use_labels: bool = True,
    max_rows: int = PREPARE_ROWS,
) -> BatchPlan:
    """``prepare_table`` and ``plan_preparation`` of the table whose batches of whole ranks are ``load(0 ..
    count - 1)`` (in table order; each called twice), holding one batch at a time (module doc): the same facts,
    plan and windows (of at most ``max_rows`` rows). A batch's columns beyond ``PLAN_COLUMNS`` are not read. Raises
    ValueError when the batches hold no row."""
    # Pass 1: roles, coordinates, the facts' counts.
    coord_parts: list[pl.DataFrame] = []
    rank_parts: list[pl.DataFrame] = []
    heights: list[int] = []
    nulls: Counter[str] = Counter()
    values: dict[str, set] = {}
    n_timed, timed_ranks, n_p2p, columns = 0, set(), 0, []
    for i in range(count):
        df = canonical_order(load(i))  # the whole table's order (prepare_table): batches are whole ranks
        columns = df.columns
        heights.append(df.height)
        coord_parts.append(coordinate_rows(df))
        present = [c for c in COORDS if c in df.columns]
        if present:
            rank_parts.append(df.group_by("rank", maintain_order=True).agg(pl.col(c).first() for c in present))
        for c in [*_LABELS, "step"]:
            if c in df.columns:
                nulls[c] += df.get_column(c).null_count()
        for c in present:
            values.setdefault(c, set()).update(df.get_column(c).unique().to_list())
        n_timed += int(df.select(TIMED.sum()).item())
        timed_ranks.update(df.get_column("rank").filter(df.select(TIMED).to_series()).unique().to_list())
        n_p2p += int(df.get_column("is_p2p").sum())
        del df
    total = sum(heights)
    if total == 0:
        raise ValueError("no operations to analyse")
    coord = pl.concat(coord_parts, how="vertical_relaxed")
    del coord_parts
    labelled = use_labels and "step" in columns and nulls["step"] == 0
    roles = infer_roles(coord)
    shape_alone = all(nulls[c] == total for c in _LABELS if c in columns)

    # Pass 2: steps, and what the windows and the plan need of them.
    bucket_rows = min(max_rows, PLAN_BATCH_ROWS)
    n_instance_buckets = max(1, math.ceil(total / bucket_rows))
    n_p2p_buckets = max(1, math.ceil(n_p2p / bucket_rows))
    instance_keys: dict[int, list[str]] = {}
    p2p_keys: dict[int, list[str]] = {}
    batches: list[str] = []
    counts = pl.DataFrame(schema={"_step": pl.Int64, "len": pl.UInt32})
    starts: dict[bool, list[pl.DataFrame]] = {True: [], False: []}
    methods: dict[int, str] = {}
    n_comm = n_unissued = 0
    any_step = False
    offset = 0
    for i in range(count):
        df = canonical_order(load(i)).with_row_index("row", offset=offset).with_columns(pl.col("row").cast(pl.Int64))
        offset += df.height
        if labelled:
            df = df.with_columns(pl.col("step").alias("_step"))
        else:
            report = recover_steps(df.drop("row"), roles=roles, shape_alone=shape_alone)
            methods.update(report.methods_by_rank)
            df = steps_from_starts(df, report.rank_steps)
        rows = df.select(*_WINDOW_COLUMNS)
        del df
        any_step = any_step or bool(rows.select((pl.col("_step") >= 0).any()).item())
        step_counts = rows.group_by("_step").len().cast({"_step": pl.Int64, "len": pl.UInt32})
        counts = pl.concat([counts, step_counts]).group_by("_step").agg(pl.col("len").sum())
        n, u = rows.select(COMM_ROW.sum().alias("n"), (COMM_ROW & pl.col("enqueue_ns").is_null()).sum().alias("u")).row(
            0
        )
        n_comm, n_unissued = n_comm + n, n_unissued + u
        for model in (True, False):
            starts[model].append(next_starts(rows.lazy(), model).collect())
        spans = instance_steps(rows.lazy()).with_columns(_b=pl.col("seq") % n_instance_buckets).collect()
        for (b,), part in spans.partition_by("_b", as_dict=True).items():
            key = f"instances-{b:04d}-{i:06d}"
            scratch.write(key, part.drop("_b"))
            instance_keys.setdefault(int(b), []).append(key)
        p2p = rows.filter(pl.col("is_p2p")).with_columns(
            _b=(pl.col("comm_id").hash(seed=0) % n_p2p_buckets).cast(pl.Int64)
        )
        for (b,), part in p2p.partition_by("_b", as_dict=True).items():
            key = f"p2p-{b:04d}-{i:06d}"
            scratch.write(key, part.drop("_b"))
            p2p_keys.setdefault(int(b), []).append(key)
        batches.append(_batch_key(i))
        scratch.write(batches[-1], rows.sort("_step", "row"))
        del rows, spans, p2p

    # The spans the windows must not cut, and the pairs: bucket by bucket.
    span_parts = []
    for keys in instance_keys.values():
        merged = scratch.read(keys).group_by("comm_id", "op", "seq").agg(pl.col("lo").min(), pl.col("hi").max())
        span_parts.append(merged.filter(pl.col("lo") < pl.col("hi")).select("lo", "hi"))
    pair_parts = []
    for keys in p2p_keys.values():
        bucket = scratch.read(keys)
        pairs = p2p_pairs(bucket)
        pair_parts.append(pairs)
        span_parts.append(pair_spans(pairs, bucket.select("row", "_step")))
        del bucket
    pairs = (
        pl.concat(pair_parts, how="vertical_relaxed").sort("row")
        if pair_parts
        else pl.DataFrame(schema={"row": pl.Int64, "partner_row": pl.Int64})
    )
    spans = (
        pl.concat(span_parts, how="vertical_relaxed")
        if span_parts
        else pl.DataFrame(schema={"lo": pl.Int64, "hi": pl.Int64})
    )
    windows = window_bounds(counts.sort("_step"), spans, max_rows)

    evidence = insufficient(n_timed, len(timed_ranks))
    if evidence is None and not any_step:
        evidence = NO_STEP
    coords = [c for c in COORDS if c in columns and nulls[c] == 0 and len(values[c]) > 1]
    given = [c for c in COORDS if c in columns and nulls[c] < total]
    step_source = "labels"
    if not labelled:
        step_source = f"recovered ({Counter(methods.values()).most_common(1)[0][0] if methods else 'none'})"
    facts = JobFacts(
        evidence=evidence,
        step_source=step_source,
        coords=coords,
        rank_coord=pl.concat(rank_parts).select("rank", *coords) if coords else None,
        infer=not given,
        inferred=infer_coordinates(coord) if not given and evidence is None else None,
    )
    issue_model = bool(n_comm) and n_unissued == 0
    plan = PreparationPlan(
        windows=windows,
        pairs=pairs,
        roles=roles if evidence is None else {},
        issue_model=issue_model,
        prepare=evidence is None,
        next_starts=pl.concat(starts[issue_model]).sort("rank", "_step"),
    )
    return BatchPlan(facts, plan, batches)


def window_parts(scratch: Scratch, planned: BatchPlan, index: int) -> Iterator[pl.DataFrame]:
    """The rows of window ``index`` (``window_rows`` of the whole table) batch by batch, in table order: each batch's
    rows of the window's steps, read from its rows sorted by step (row groups of other steps skipped)."""
    lo, hi = planned.plan.windows[index]
    for key in planned.batches:
        yield scratch.read([key], None if index == 0 else lo, hi).sort("row").select(*_WINDOW_COLUMNS)


def window_frame(scratch: Scratch, planned: BatchPlan, index: int) -> pl.DataFrame:
    """The rows of window ``index`` in one frame (``window_parts`` concatenated)."""
    return pl.concat(window_parts(scratch, planned, index), how="vertical_relaxed")


def write_window(scratch: Scratch, planned: BatchPlan, index: int, sink: str | Path | BinaryIO) -> None:
    """Window ``index``'s rows (``window_frame``) written as Parquet to ``sink``, one batch's rows at a time (a
    window of the whole job, when the steps leave no boundary to cut at, is never held uncompressed)."""
    writer: pq.ParquetWriter | None = None
    for part in window_parts(scratch, planned, index):
        table = part.to_arrow()
        if writer is None:
            writer = pq.ParquetWriter(sink, table.schema, compression="zstd")
        writer.write_table(table.cast(writer.schema))
    if writer is not None:
        writer.close()
