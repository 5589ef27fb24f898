"""Analyses over a partitioned operations store: what a map task keeps of its partition, and the reduce.

A job's store is partitioned (the site keeps one Parquet file per archive per rank); a map task
reads one partition and returns a *summary*, a reduce merges the summaries into the report the
unpartitioned analysis gives on the same rows. Memory per map task is bounded by its partition;
the reduce holds summaries, not the job's rows.

- **hang** — partitions of whole ranks (every row of a rank in one partition). ``hang_tail`` keeps
  the rows ``analyze_hang`` can look at, in the columns it reads: everything not completed, the last
  ``HANG_TAIL_SEQS`` completed sequences of every (stream, rank) - the tail of every communicator -
  and the few rows that carry a per-(communicator, rank) fact (first row, latest time, latest record,
  names, sizes, positions). ``hang_merge`` folds the tails in two passes, one partition at a time:
  pass 1 finds each stream's *floor*, the lowest completion watermark of its members; pass 2 keeps of
  each tail only the completed rows at or above its stream's floor (with the fact rows), then
  concatenates them in partition order for ``analyze_hang`` (``hang_reduce``). No blocking sequence
  lies below a floor (every member completed it), so this drops nothing the analysis reads, and a
  job whose members stopped together keeps a few rows per (stream, rank) instead of the tail's.
  Exact while the completion watermarks of one stream's members differ by less than HANG_TAIL_SEQS
  (a collective completes on all its members together; a larger gap means a member's records were
  lost).
- **perf** — partitions of whole communicators (every member's rows of the communicator), since
  operations are matched across members. ``perf_map`` returns the exact per-(communicator, op,
  size) medians and, per transfer, the five numbers the per-rank and per-link medians need;
  ``perf_reduce`` takes the reference bandwidths from the groups and the medians from those
  samples; ``perf_reduce_by_rank`` does the same holding one range of ranks' samples at a time
  (every sample of a rank is needed for its median), so the merge's memory is the groups plus one range.
  A communicator of more rows than a partition is cut into *slices* of its sequence numbers (``seq_slices``,
  ``slice_rows``: an instance of a collective is never cut, so each transfer is measured as on the whole
  table); ``perf_slice_map`` returns a slice's per-transfer values instead of medians, and ``slice_groups``
  takes the medians over every slice exactly, one slice at a time (a counting selection).
- **steps** — partitions of whole ranks, two stages. The step engine runs per rank; what it needs from
  other ranks is the communicators' roles and each event's exposed waiting (how long it waited for the
  last member of its operation). Stage 1, ``steps_evidence``: per partition, the role rows, the
  collective instances its ranks saw (last arrival, ranks seen) and its point-to-point
  rows. ``steps_links`` merges them: the roles, the instances of two or more members (their last
  arrival) of the communicators that span partitions (a partition finds its own communicators'
  alone), every point-to-point event's waiting (pairing sends and receives needs them all), and whether the
  job's roles come from the communicators' shape alone (every partition's, never one partition's: it turns
  on the template-against-period check of every map task, as ``shape_alone`` does the stragglers planning's).
  Stage 2, ``steps_map``: the engine over one partition's ranks with those, giving per-(rank, step)
  summaries; ``steps_merge`` folds them, one partition at a time, into per-step totals (``step_totals``: sums
  and extremes, exact over any split of the ranks) and, when asked, the ``StepReport`` the whole table gives
  (``steps_reduce``), whose per-(rank, step) rows only a small job's merge needs to hold.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from comminsight.analysis.hang import analyze_hang
from comminsight.analysis.hang_evidence import COLUMNS as HANG_COLUMNS
from comminsight.analysis.perf import (
    GROUP_KEYS,
    GROUP_MEDIANS,
    NO_PAYLOAD,
    P10,
    bandwidth_groups,
    group_medians,
    group_p10,
    perf_report,
    rank_samples,
    transfers,
)
from comminsight.evidence import PROGRESS_OP
from comminsight.evidence.schema import empty_table
from comminsight.semantic.engine import summaries_frame
from comminsight.semantic.matching import collective_instances, collective_waits, match_operations
from comminsight.semantic.order import canonical_order
from comminsight.semantic.roles import ROLES, infer_roles, role_rows, roles_from_shape_alone
from comminsight.semantic.steps import StepReport, agreement_from_counts, job_steps, label_counts, recover_steps

HANG_TAIL_SEQS = 64  # completed sequences kept per (stream, rank) below its completion watermark


def _frame(table: pa.Table | pl.DataFrame) -> pl.DataFrame:
    df = table if isinstance(table, pl.DataFrame) else pl.from_arrow(table)
    assert isinstance(df, pl.DataFrame)
    return df


# What a hang tail keeps of each row: the columns the analysis reads, and each rank's position in its
# communicator (naming the communicators on the site reads it).
TAIL_COLUMNS = [*HANG_COLUMNS, "comm_rank"]
_STREAM_KEYS = ["comm_id", "seq_kind", "_sop"]


def _stream_columns(df: pl.DataFrame) -> pl.DataFrame:
    stream = ~pl.col("is_p2p") & pl.col("seq").is_not_null() & pl.col("seq_kind").is_not_null()
    sop = pl.when(pl.col("seq_kind") == "func").then(pl.col("op")).otherwise(pl.lit(""))
    return df.with_columns(_stream=stream, _sop=sop)


def hang_tail(
    table: pa.Table | pl.DataFrame, tail_seqs: int = HANG_TAIL_SEQS, floors: pl.DataFrame | None = None
) -> pl.DataFrame:
    """The rows of one partition (whole ranks) that the hang analysis reads, in their original order.

    With ``floors`` (``hang_floors`` of every partition, merged), the completed rows of a stream kept
    are those at or above the stream's floor instead of the last ``tail_seqs`` (a tail given again
    with floors loses only rows no analysis reads)."""
    df = _frame(table)
    df = df.select([c for c in TAIL_COLUMNS if c in df.columns]).filter(pl.col("op") != "compute")
    df = df.with_row_index("_r")
    if df.is_empty():
        return df.drop("_r")
    done = pl.col("state") == "completed"
    real = pl.col("op") != PROGRESS_OP
    df = _stream_columns(df)
    when_t = pl.max_horizontal("enqueue_ns", "start_ns", "end_ns")
    first_t = pl.min_horizontal(
        pl.col("enqueue_ns").fill_null(0).replace(0, None), pl.col("start_ns").fill_null(0).replace(0, None)
    )
    df = df.with_columns(
        _t=pl.when(real).then(when_t),
        _first_t=pl.when(real).then(first_t),
        _real=real,
    )
    group = ["_stream", "comm_id", "seq_kind", "_sop", "rank"]  # a stream per rank; other rows per communicator
    cr = ["comm_id", "rank"]
    crp = [*cr, "is_p2p"]
    p2p_op = ["rank", "comm_id", "op", "peer", "seq"]
    watermark = ~real & done
    # Window values first (polars takes no window inside another's aggregation).
    df = df.with_columns(
        _wm=pl.col("seq").filter(done).max().over(group),
        _t_max=pl.col("_t").max().over(group),
        _size_max=pl.col("comm_size").max().over(group),
        _first_t_min=pl.col("_first_t").min().over(cr),
        _progress_max=pl.col("seq").filter(watermark).max().over(crp),
        # A p2p operation (with a sequence) is pending only when none of its rows completed: keep its
        # completed rows with the others.
        _p2p_open=pl.col("is_p2p") & pl.col("seq").is_not_null() & (~done).any().over(p2p_op),
    )

    def first_where(condition: pl.Expr, over: list[str]) -> pl.Expr:
        return pl.col("_r") == pl.col("_r").filter(condition).min().over(over)

    if floors is None:
        window = pl.col("_wm").is_null() | (pl.col("seq") >= pl.col("_wm") - tail_seqs)
    else:
        df = df.join(floors.rename({"floor": "_floor"}), on=_STREAM_KEYS, how="left", maintain_order="left")
        # No floor: some member of the stream completed nothing, so any of its sequences may block.
        window = pl.col("_floor").is_null() | (pl.col("seq") >= pl.col("_floor"))
    keep = (
        ~done
        | (pl.col("_stream") & window)
        | pl.col("_p2p_open")
        # per (stream or communicator, rank): first row, latest time, latest record, largest size
        | (pl.col("_r") == pl.col("_r").min().over(group))
        | (pl.col("_t").is_not_null() & (pl.col("_t") == pl.col("_t_max")))
        | (pl.col("_r") == pl.col("_r").filter(pl.col("_real")).max().over(group))
        | first_where(pl.col("comm_size") == pl.col("_size_max"), group)
        # per (communicator, rank): what membership and names are read from
        | first_where(pl.col("comm_ranks").is_not_null(), cr)
        | first_where(pl.col("comm_name").is_not_null(), cr)
        | first_where(pl.col("comm_desc").is_not_null(), cr)
        | first_where(pl.col("comm_rank").is_not_null(), cr)
        | first_where(pl.col("seq").is_not_null(), cr)
        | first_where(pl.col("_first_t") == pl.col("_first_t_min"), cr)
        | (pl.col("_r") == pl.col("_r").min().over(crp))
        # progress watermarks of P2P sequences
        | first_where(watermark & (pl.col("seq") == pl.col("_progress_max")), crp)
    )
    return df.filter(keep.fill_null(False)).select(c for c in TAIL_COLUMNS if c in df.columns)


def hang_floors(tail: pl.DataFrame) -> pl.DataFrame:
    """Per stream (comm_id, seq_kind, _sop) of one partition's tail: ``floor``, the lowest completion
    watermark of its ranks there; null when one of them completed nothing in it."""
    schema = {"comm_id": pl.String, "seq_kind": pl.String, "_sop": pl.String, "floor": pl.Int64}
    if tail.is_empty():
        return pl.DataFrame(schema=schema)
    streams = _stream_columns(tail.select("rank", "comm_id", "op", "is_p2p", "seq", "seq_kind", "state"))
    watermarks = (
        streams.filter(pl.col("_stream"))
        .group_by(*_STREAM_KEYS, "rank")
        .agg(pl.col("seq").filter(pl.col("state") == "completed").max().alias("wm"))
    )
    return _lowest(watermarks).cast(schema)  # type: ignore[arg-type]


def _lowest(watermarks: pl.DataFrame) -> pl.DataFrame:
    """Per stream the lowest of ``wm`` (or ``floor``), null as soon as one is null."""
    column = "wm" if "wm" in watermarks.columns else "floor"
    return watermarks.group_by(_STREAM_KEYS).agg(
        pl.when(pl.col(column).null_count() == 0).then(pl.col(column).min()).alias("floor")
    )


def hang_merge(count: int, load: Callable[[int], pl.DataFrame]) -> pl.DataFrame:
    """The tails of partitions ``0 .. count - 1`` (``load(i)``: partition i's, as ``hang_tail`` gave it)
    folded for ``analyze_hang``, in partition order: two passes, holding one tail at a time beside the
    floors (one row per stream) and what the second pass keeps."""
    floors: pl.DataFrame | None = None
    for i in range(count):
        part = hang_floors(load(i))
        floors = part if floors is None else _lowest(pl.concat([floors, part]))
    frames = []
    for i in range(count) if floors is not None else ():
        kept = hang_tail(load(i), floors=floors)
        if kept.height:
            frames.append(kept)
    return pl.concat(frames, how="vertical_relaxed") if frames else pl.from_arrow(empty_table())  # type: ignore[return-value]


def hang_reduce(count: int, load: Callable[[int], pl.DataFrame], *, silence_s: float = 60.0) -> dict[str, Any]:
    """The hang report from the partitions' tails (``load(i)``: partition i's, partitions in order)."""
    return analyze_hang(hang_merge(count, load), silence_s=silence_s)


def perf_map(table: pa.Table | pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame] | None:
    """(per-communicator groups, per-transfer samples) of one partition of whole communicators; None:
    no operation with a payload."""
    ev = transfers(table)
    if ev is None:
        return None
    return bandwidth_groups(ev), rank_samples(ev)


def perf_reduce(
    parts: Iterable[tuple[pl.DataFrame, pl.DataFrame] | None], slow_fraction: float = 0.5, min_samples: int = 3
) -> dict[str, Any]:
    """The performance report from the partitions' ``perf_map`` results."""
    present = [p for p in parts if p is not None]
    if not present:
        return dict(NO_PAYLOAD)
    groups = pl.concat([g for g, _ in present], how="vertical_relaxed")
    samples = pl.concat([s for _, s in present], how="vertical_relaxed")
    return perf_report(groups, samples, slow_fraction, min_samples)


def perf_reduce_by_rank(
    groups: Iterable[pl.DataFrame],
    sample_chunks: Iterable[pl.DataFrame],
    slow_fraction: float = 0.5,
    min_samples: int = 3,
) -> dict[str, Any]:
    """``perf_reduce`` holding one chunk of samples at a time: ``sample_chunks`` each carry every sample of
    a disjoint set of ranks (all partitions' samples of those ranks), so the merge's memory is the
    per-communicator groups plus one chunk."""
    frames = list(groups)
    if not frames:  # no partition had an operation with a payload
        return dict(NO_PAYLOAD)
    return perf_report(pl.concat(frames, how="vertical_relaxed"), sample_chunks, slow_fraction, min_samples)


# --- perf: a communicator too large for one partition, in slices -------------------------------------------------

SLICE_VALUES = [*GROUP_KEYS, "bytes", "algbw", "busbw", "transfer_ns"]
SELECT_LIMIT = 200_000  # window values at which a selection stops narrowing and takes its value exactly
SELECT_SAMPLE = 4096  # values sampled from a larger window to narrow it
SELECT_BUDGET = 16_000_000  # window values collected at most by one batch of selections (~128 MiB; more: batches)


SEQ_BUCKETS = 1024  # a large communicator's sequence numbers are counted in this many ranges to plan its slices


def seq_bucket_width(low: int, high: int) -> int:
    """The width of the ranges a communicator's sequence numbers ``low`` .. ``high`` are counted in."""
    return max(1, -(-(high - low + 1) // SEQ_BUCKETS))


def seq_bucket(low: int, width: int) -> pl.Expr:
    """A row's range of sequence numbers (-1: a point-to-point row or one without a sequence number, which
    the first slice holds: pairing sends with receives needs every one of the communicator's)."""
    return (
        pl.when(pl.col("is_p2p") | pl.col("seq").is_null())
        .then(pl.lit(-1, pl.Int64))
        .otherwise((pl.col("seq") - low) // width)
    )


def slice_rows(start: int | None, end: int | None) -> pl.Expr:
    """A communicator's rows in its slice [start, end) of sequence numbers, as ``seq_bucket`` places them."""
    collective = ~pl.col("is_p2p") & pl.col("seq").is_not_null()
    if start is not None:
        collective = collective & (pl.col("seq") >= start)
    if end is not None:
        collective = collective & (pl.col("seq") < end)
    if start is None:  # the first slice
        return collective | pl.col("is_p2p") | pl.col("seq").is_null()
    return collective


def seq_slices(rows: dict[int, int], low: int, width: int, max_rows: int) -> list[tuple[int | None, int | None]]:
    """A communicator's slices, [from, to) of sequence numbers (None: unbounded), from its rows per ``seq_bucket``:
    consecutive ranges up to ``max_rows`` rows each (one range alone when larger; an instance of a collective,
    one sequence number, is never cut)."""
    groups: list[list[int]] = []
    held = 0
    for bucket in sorted(rows):
        if groups and held + rows[bucket] > max_rows:
            groups.append([])
            held = 0
        if not groups:
            groups.append([])
        groups[-1].append(bucket)
        held += rows[bucket]
    cuts = [low + group[0] * width for group in groups[1:]]  # a slice ends where the next one starts
    return list(zip([None, *cuts], [*cuts, None], strict=True))


def perf_slice_map(table: pa.Table | pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame] | None:
    """(per-transfer values, per-transfer samples) of a *slice* of one communicator: every member's rows of its
    collectives of a range of sequence numbers (an instance's rows are all in one slice, so each transfer is
    measured as on the whole table), the first slice also holding its point-to-point rows and rows without a
    sequence number. Medians over slices are taken by ``slice_groups``; None: no operation with a payload."""
    ev = transfers(table)
    if ev is None:
        return None
    return ev.select(SLICE_VALUES), rank_samples(ev)


def nearest_index(n: int, q: float) -> int:
    """The position (0-based, sorted) of the value polars' default ("nearest") quantile ``q`` of ``n`` values is:
    (n - 1) x q rounded half away from zero."""
    x = (n - 1) * q
    whole = math.floor(x)
    return whole + (1 if x - whole >= 0.5 else 0)


@dataclass
class _Selection:
    """Finding the value at sorted position ``position`` of one group's column over every slice. It lies strictly
    between ``lo`` and ``hi`` (None: unbounded), where ``below`` values are <= lo and ``inside`` values are in the
    window; ``pivots``: window values whose exact counts the next pass takes."""

    group: tuple
    column: str
    position: int
    inside: int
    lo: Any = None
    hi: Any = None
    below: int = 0
    pivots: np.ndarray | None = None
    value: Any = None
    done: bool = False


def _window(values: np.ndarray, sel: _Selection) -> tuple[int, np.ndarray]:
    """(how many of the sorted ``values`` are <= sel.lo, those strictly between sel.lo and sel.hi)."""
    a = 0 if sel.lo is None else int(np.searchsorted(values, sel.lo, "right"))
    b = len(values) if sel.hi is None else int(np.searchsorted(values, sel.hi, "left"))
    return a, values[a:b]


def _select(batch: list[_Selection], slices: list[int], load: Callable[[int], pl.DataFrame]) -> None:
    """Find the values of ``batch`` exactly, reading ``slices`` (those holding its groups) one at a time per pass.
    A window of at most
    SELECT_LIMIT values is collected and sorted; a larger one is sampled (about SELECT_SAMPLE values, evenly by
    rank within each slice), and the next pass counts exactly how many values lie below and at each sample: the
    value is a sample, or the window shrinks to the values between two neighbouring samples."""
    for _ in range(128):  # each sample-and-count round shrinks a window ~SELECT_SAMPLE times: a few rounds do
        open_ = [s for s in batch if not s.done]
        if not open_:
            return
        by_column: dict[tuple, dict[str, list[_Selection]]] = {}
        for sel in open_:
            by_column.setdefault(sel.group, {}).setdefault(sel.column, []).append(sel)
        found: dict[int, list[np.ndarray]] = {id(s): [] for s in open_}
        windows: dict[tuple, list[np.ndarray]] = {}  # collected windows, shared by the selections of one window
        less = {id(s): np.zeros(len(s.pivots), np.int64) for s in open_ if s.pivots is not None}
        upto = {id(s): np.zeros(len(s.pivots), np.int64) for s in open_ if s.pivots is not None}
        for i in slices:
            frame = load(i)
            for group, part in frame.partition_by(GROUP_KEYS, as_dict=True).items():
                for column, selections in by_column.get(group, {}).items():
                    values = np.sort(part.get_column(column).to_numpy())
                    collected: set[tuple] = set()
                    for sel in selections:
                        if sel.inside <= SELECT_LIMIT:  # collect the window (once for selections sharing it)
                            key = (group, column, sel.lo, sel.hi)
                            if key not in collected:
                                collected.add(key)
                                windows.setdefault(key, []).append(_window(values, sel)[1])
                        elif sel.pivots is None:  # sample it
                            window = _window(values, sel)[1]
                            found[id(sel)].append(window[:: -(-sel.inside // SELECT_SAMPLE)])
                        else:  # count values below and at each pivot
                            less[id(sel)] += np.searchsorted(values, sel.pivots, "left")
                            upto[id(sel)] += np.searchsorted(values, sel.pivots, "right")
            del frame
        for sel in open_:
            if sel.inside <= SELECT_LIMIT:
                window = np.sort(np.concatenate(windows[(sel.group, sel.column, sel.lo, sel.hi)]))
                sel.value, sel.done = window[sel.position - sel.below].item(), True
            elif sel.pivots is None:
                sel.pivots = np.unique(np.concatenate(found[id(sel)]))
            else:
                _narrow(sel, less[id(sel)], upto[id(sel)])
    raise RuntimeError("perf: the selection of a sliced communicator's medians did not settle")


def _narrow(sel: _Selection, less: np.ndarray, upto: np.ndarray) -> None:
    """With exact counts of the values below (``less``) and at or below (``upto``) each pivot: the pivot whose
    run of equal values holds ``position`` is the value; else the window becomes the values between the two
    pivots around it."""
    assert sel.pivots is not None
    pivots, sel.pivots = sel.pivots, None
    at = np.flatnonzero((less <= sel.position) & (sel.position < upto))
    if at.size:
        sel.value, sel.done = pivots[at[0]].item(), True
        return
    j = int(np.searchsorted(less, sel.position, "right"))  # first pivot with more than ``position`` values below
    end = sel.below + sel.inside  # values <= the window's top
    if j < len(pivots):
        sel.hi, end = pivots[j], int(less[j])
    if j > 0:
        sel.lo, sel.below = pivots[j - 1], int(upto[j - 1])
    sel.inside = end - sel.below


def slice_groups(count: int, load: Callable[[int], pl.DataFrame]) -> pl.DataFrame | None:
    """``bandwidth_groups`` of the sliced communicators from their slices' ``perf_slice_map`` values (``load(i)``:
    slice i's), exactly as over their whole rows, holding one slice at a time: the groups' sizes are counted, then
    the values at the positions polars' median and quantile read are found by a counting selection (windows
    narrowed by samples until small, then sorted), and polars' own median and quantile of those values give the
    figures (a median of the one or two middle values, a "nearest" quantile of the one value it takes). None: no
    slice had a transfer."""
    sizes, schema = [], None
    holders: dict[tuple, list[int]] = {}  # the slices holding each group
    for i in range(count):
        values = load(i)
        schema = values.select(SLICE_VALUES).schema
        sizes.append(values.group_by(GROUP_KEYS).agg(samples=pl.len().cast(pl.Int64)))
        for row in sizes[-1].select(GROUP_KEYS).iter_rows():
            holders.setdefault(row, []).append(i)
        del values
    present = [f for f in sizes if f.height]
    if not present or schema is None:
        return None
    counts = pl.concat(present, how="vertical_relaxed").group_by(GROUP_KEYS).agg(pl.col("samples").sum())
    size = {tuple(row[:-1]): int(row[-1]) for row in counts.iter_rows()}
    middles = {group: sorted({(n - 1) // 2, n // 2}) for group, n in size.items()}
    selections: list[_Selection] = []
    for group, n in sorted(size.items(), key=str):  # a batch holds few communicators: it reads only their slices
        for column in GROUP_MEDIANS.values():
            selections += [_Selection(group, column, k, n) for k in middles[group]]
        selections.append(_Selection(group, "busbw", nearest_index(n, P10), n))

    def run(batch: list[_Selection]) -> None:
        _select(batch, sorted({i for sel in batch for i in holders[sel.group]}), load)

    batch: list[_Selection] = []
    held, seen = 0, set()
    for sel in selections:  # batches whose collected windows stay within SELECT_BUDGET values
        cost = 0 if (sel.group, sel.column) in seen else min(size[sel.group], SELECT_LIMIT)
        if batch and held + cost > SELECT_BUDGET:
            run(batch)
            batch, held, seen = [], 0, set()
            cost = min(size[sel.group], SELECT_LIMIT)
        batch.append(sel)
        seen.add((sel.group, sel.column))
        held += cost
    run(batch)
    found = {(s.group, s.column, s.position): s.value for s in selections}
    middle = pl.DataFrame(
        [
            (*group, *(found[(group, column, k)] for column in GROUP_MEDIANS.values()))
            for group, ks in middles.items()
            for k in ks
        ],
        schema={c: schema[c] for c in [*GROUP_KEYS, *GROUP_MEDIANS.values()]},
        orient="row",
    )
    tenth = pl.DataFrame(
        [(*group, found[(group, "busbw", nearest_index(n, P10))]) for group, n in size.items()],
        schema={c: schema[c] for c in [*GROUP_KEYS, "busbw"]},
        orient="row",
    )
    return (
        counts.cast({c: schema[c] for c in GROUP_KEYS})
        .join(middle.group_by(GROUP_KEYS).agg(**group_medians()), on=GROUP_KEYS)
        .join(tenth.group_by(GROUP_KEYS).agg(busbw_p10_gbs=group_p10()), on=GROUP_KEYS)
        .select(*GROUP_KEYS, "samples", "bytes", "algbw_gbs", "busbw_gbs", "busbw_p10_gbs", "transfer_us")
    )


# --- steps: two stages over whole ranks -----------------------------------------------------------------------

STEPS_FOLD_ROWS = 2_000_000  # instance rows read before the merge folds them into what it holds
P2P_COLUMNS = ["rank", "comm_id", "op", "is_p2p", "seq", "peer", "comm_size", "start_ns", "end_ns", "enqueue_ns"]


@dataclass
class StepsEvidence:
    """What one partition of whole ranks tells the others (stage 1 of a partitioned steps run)."""

    role_rows: pl.DataFrame  # comminsight.semantic.roles.role_rows
    instances: pl.DataFrame  # collective_instances: key, comm_id, last, n_members
    p2p: pl.DataFrame  # the point-to-point rows, ``_i``: their row in the partition (in ``canonical_order``)
    shape_alone: bool | None = None  # roles_from_shape_alone of the partition (None: not recorded)


@dataclass
class StepsLinks:
    """The job-wide facts every partition's step engine needs (stage 1's merge)."""

    roles: dict[str, str]
    instances: pl.DataFrame  # key, comm_id, last: collective instances of two or more members
    p2p_waits: pl.DataFrame  # part, _i, wait_ns: point-to-point events that waited
    shared: list[str]  # communicators seen by several partitions (``instances`` holds theirs)
    role_rows: int = 0  # 0: the partitions held no operation
    # Roles from the communicators' shape alone in the whole job (every partition's): the template check of
    # every map task (``recover_steps``'s ``shape_alone``); None: a partition's evidence did not record it.
    shape_alone: bool | None = None


@dataclass
class StepsPart:
    """One partition's step recovery (stage 2): its ranks' steps, methods and label agreement counts."""

    rank_steps: pl.DataFrame
    methods: dict[int, str]
    label_counts: pl.DataFrame | None  # None: the partition's rows are not all step-labelled


def steps_evidence(table: pa.Table | pl.DataFrame) -> StepsEvidence:
    """Stage 1 of a partitioned steps run over one partition of whole ranks (any row order: read in
    ``canonical_order``, as ``recover_steps`` reads the whole table)."""
    df = canonical_order(_frame(table))
    p2p = df.with_row_index("_i").filter(pl.col("is_p2p")).select("_i", *P2P_COLUMNS)
    return StepsEvidence(
        role_rows(df),
        collective_instances(df),
        p2p.with_columns(pl.col("_i").cast(pl.Int64)),
        roles_from_shape_alone(df),
    )


def _merge_instances(frames: list[pl.DataFrame]) -> pl.DataFrame:
    """Instances seen by disjoint sets of ranks, merged: latest arrival, ranks seen added up."""
    return (
        pl.concat(frames, how="vertical_relaxed")
        .group_by("key")
        .agg(comm_id=pl.col("comm_id").first(), last=pl.col("last").max(), n_members=pl.col("n_members").sum())
    )


def steps_links(count: int, load: Callable[[int], StepsEvidence], fold_rows: int = STEPS_FOLD_ROWS) -> StepsLinks:
    """Merge the evidence of partitions ``0 .. count - 1`` (``load(i)``: partition i's), one at a time, in two
    passes. Pass 1 finds the communicators seen by more than one partition (a communicator whose ranks are all
    in one partition is that partition's own: its map task finds its instances alone); pass 2 merges those
    communicators' instances, folding every ``fold_rows`` rows, so the merge holds the shared instances plus
    that many rows."""
    role_frames: list[pl.DataFrame] = []
    p2p_frames: list[pl.DataFrame] = []
    seen_by: dict[str, int] = {}
    shape_flags: list[bool | None] = []
    for i in range(count):
        evidence = load(i)
        shape_flags.append(evidence.shape_alone)
        role_frames.append(evidence.role_rows)
        p2p_frames.append(evidence.p2p.with_columns(part=pl.lit(i, pl.Int64)))
        for comm in evidence.instances.get_column("comm_id").unique().to_list():
            seen_by[comm] = seen_by.get(comm, 0) + 1
    shared = sorted(c for c, n in seen_by.items() if n > 1)
    merged: list[pl.DataFrame] = []
    pending: list[pl.DataFrame] = []
    pending_rows = 0
    for i in range(count) if shared else ():
        instances = load(i).instances.filter(pl.col("comm_id").is_in(shared))
        pending.append(instances)
        pending_rows += instances.height
        if pending_rows >= fold_rows:
            merged, pending, pending_rows = [_merge_instances(merged + pending)], [], 0
    frames = merged + pending
    instances = (
        _merge_instances(frames).filter(pl.col("n_members") > 1).select("key", "comm_id", "last").sort("comm_id")
        if frames
        else pl.DataFrame(schema={"key": pl.String, "comm_id": pl.String, "last": pl.Int64})
    )
    del merged, pending, frames
    role_rows = pl.concat(role_frames, how="vertical_relaxed") if role_frames else pl.DataFrame()
    # Rows in rank order (the whole table's): each rank's rows come from one partition, in their order.
    roles = infer_roles(role_rows.sort("rank", maintain_order=True)) if role_rows.height else {}
    p2p = (
        pl.concat(p2p_frames, how="vertical_relaxed")
        .sort("rank", "_i", maintain_order=True)
        .with_row_index("row")
        .with_columns(pl.col("row").cast(pl.Int64))
    )
    waits = match_operations(p2p).select("row", "wait_ns")
    p2p_waits = (
        p2p.select("row", "part", "_i")
        .join(waits, on="row")
        .filter(pl.col("wait_ns") > 0)
        .select("part", "_i", "wait_ns")
        .sort("part", "_i")
    )
    shape_alone = None if None in shape_flags else all(shape_flags)
    return StepsLinks(roles, instances, p2p_waits, shared, role_rows.height, shape_alone)


def steps_map(
    table: pa.Table | pl.DataFrame,
    roles: dict[str, str],
    instances: pl.DataFrame,
    p2p_waits: pl.DataFrame,
    shared: list[str],
    use_templates: bool = True,
    shape_alone: bool | None = None,
) -> StepsPart:
    """Stage 2: recover the steps of one partition's ranks, with the job's roles and waiting (``instances`` of
    the ``shared`` communicators; ``p2p_waits``: this partition's ``_i``, ``wait_ns``) and whether the job's roles
    come from shape alone (``StepsLinks.shape_alone``; None: decided from this partition, which may differ)."""
    df = canonical_order(_frame(table))
    wait = np.zeros(df.height, np.int64)
    own = collective_instances(df).filter(~pl.col("comm_id").is_in(shared) & (pl.col("n_members") > 1))
    instances = pl.concat([instances.select("key", "last"), own.select("key", "last")], how="vertical_relaxed")
    coll = collective_waits(df.with_row_index("row"), instances)
    wait[coll.get_column("row").to_numpy()] = coll.get_column("wait_ns").to_numpy()
    wait[p2p_waits.get_column("_i").to_numpy()] = p2p_waits.get_column("wait_ns").to_numpy()
    report = recover_steps(df, use_templates=use_templates, wait_ns=wait, roles=roles, shape_alone=shape_alone)
    counts = None
    if "step" in df.columns and df.get_column("step").null_count() == 0:
        counts = label_counts(df.get_column("step").to_numpy()[report.event_rows], report.event_steps)
    return StepsPart(report.rank_steps, report.methods_by_rank, counts)


def step_totals(rank_steps: pl.DataFrame) -> pl.DataFrame:
    """Per step of ``rank_steps`` (one row per (rank, step)): first start, last end, ranks, their communication and
    exposed waiting summed (ns, so sums are exact), and the slowest rank (longest step; the lowest of a tie).
    Totals of disjoint sets of ranks merge exactly (``merge_step_totals``): the job's equal its partitions'."""
    comm = [f"comm_{r}_ns" for r in ROLES if f"comm_{r}_ns" in rank_steps.columns]
    duration = pl.col("end_ns") - pl.col("start_ns")
    return rank_steps.group_by("step").agg(
        start_ns=pl.col("start_ns").min(),
        end_ns=pl.col("end_ns").max(),
        ranks=pl.len().cast(pl.Int64),
        comm_ns=pl.sum_horizontal(comm).sum().cast(pl.Int64) if comm else pl.lit(0, pl.Int64),
        wait_ns=pl.col("wait_ns").sum().cast(pl.Int64),
        slowest_ns=duration.max(),
        slowest_rank=pl.col("rank").filter(duration == duration.max()).min().cast(pl.Int64),
    )


def merge_step_totals(frames: Iterable[pl.DataFrame]) -> pl.DataFrame:
    """``step_totals`` of disjoint sets of ranks merged into their union's."""
    present = [f for f in frames if f.height]
    if not present:
        return step_totals(summaries_frame([]))
    slowest = pl.col("slowest_ns") == pl.col("slowest_ns").max()
    return (
        pl.concat(present, how="vertical_relaxed")
        .group_by("step")
        .agg(
            start_ns=pl.col("start_ns").min(),
            end_ns=pl.col("end_ns").max(),
            ranks=pl.col("ranks").sum(),
            comm_ns=pl.col("comm_ns").sum(),
            wait_ns=pl.col("wait_ns").sum(),
            slowest_ns=pl.col("slowest_ns").max(),
            slowest_rank=pl.col("slowest_rank").filter(slowest).min(),
        )
    )


def step_rows(totals: pl.DataFrame) -> list[dict[str, Any]]:
    """The job's steps from their totals, in step order: span and a summary over ranks (what a steps page shows:
    ranks, mean communication and exposed waiting per rank in ms, the slowest rank)."""
    out = []
    for row in totals.sort("step").iter_rows(named=True):
        start, end, ranks = int(row["start_ns"]), int(row["end_ns"]), int(row["ranks"])
        out.append(
            {
                "step": int(row["step"]),
                "start_ns": start,
                "end_ns": end,
                "duration_ms": (end - start) / 1e6,
                "summary": {
                    "ranks": ranks,
                    "comm_ms_mean": row["comm_ns"] / ranks / 1e6,
                    "exposed_wait_ms_mean": row["wait_ns"] / ranks / 1e6,
                    "slowest_rank": int(row["slowest_rank"]),
                },
            }
        )
    return out


def steps_merge(parts: Iterable[StepsPart], per_rank: bool = True) -> tuple[StepReport, pl.DataFrame]:
    """The whole table's ``StepReport`` (without per-event arrays) and ``step_totals`` from every partition's
    ``steps_map``, taken one at a time. ``per_rank=False``: the report keeps no per-(rank, step) rows and no
    per-rank step details (its ``rank_steps`` is empty, ``steps`` too), so the merge holds the totals (steps x
    partitions rows) and each rank's method, never the job's (rank, step) rows."""
    methods: dict[int, str] = {}
    totals = merge_step_totals([])
    frames: list[pl.DataFrame] = []
    counts: pl.DataFrame | None = None
    labelled = True
    for part in parts:
        methods.update(part.methods)
        totals = merge_step_totals([totals, step_totals(part.rank_steps)])
        if per_rank and part.rank_steps.height:
            frames.append(part.rank_steps)
        if part.label_counts is None:
            labelled, counts = False, None
        elif labelled:
            merged = (
                part.label_counts if counts is None else pl.concat([counts, part.label_counts], how="vertical_relaxed")
            )
            counts = merged.group_by("rec", "lab").agg(pl.col("len").sum())
    methods = dict(sorted(methods.items()))
    method = Counter(methods.values()).most_common(1)[0][0] if methods else "none"
    rank_steps = pl.concat(frames, how="vertical_relaxed") if frames else summaries_frame([])
    rank_steps = rank_steps.sort("step", "rank")
    empty = np.zeros(0, np.int64)
    report = StepReport(
        method=method, methods_by_rank=methods, event_rows=empty, event_steps=empty, rank_steps=rank_steps
    )
    report.steps = job_steps(rank_steps)
    if labelled and counts is not None and counts.height:  # the whole table: labelled and at least one event
        report.agreement = agreement_from_counts(counts)
    return report, totals


def steps_reduce(parts: Iterable[StepsPart]) -> StepReport:
    """The ``StepReport`` of the whole table (without per-event arrays) from every partition's ``steps_map``."""
    return steps_merge(parts)[0]
