"""Evidence gathering for the hang analysis (analysis.hang): polars passes over the operations table.

One aggregation over the collective rows per (stream, rank), membership, per-rank activity, the
stuck streams with their member lists, the few rows after it (pending, at blocking sequences),
mismatches and pending P2P pairs. Everything after the aggregation works on its ~N x streams
aggregates or on the open rows only. The method is in docs/analysis-hang.md.
"""

from __future__ import annotations

from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from comminsight.evidence import PROGRESS_OP

SIZE_FREE_OPS = ("all_to_all", "gather", "scatter", "coalesced", "other", "barrier")
_NONE = -1
NO_TIME = -(2**63)  # below any timestamp; stands for "no time" inside aggregations
_RANK_SPAN = 1 << 31  # ranks are int32: (communicator code, rank) packs into one int64 key


# The columns of the operations table the hang analysis reads.
COLUMNS = (
    "rank",
    "comm_id",
    "comm_name",
    "comm_desc",
    "comm_size",
    "comm_ranks",
    "op",
    "is_p2p",
    "seq",
    "seq_kind",
    "count",
    "dtype",
    "shape",
    "peer",
    "state",
    "enqueue_ns",
    "start_ns",
    "end_ns",
    "record_id",
)


def frame(table: pa.Table | pl.DataFrame) -> pl.DataFrame:
    keep = list(COLUMNS)
    # Only the columns used here cross from Arrow to polars, without re-chunking.
    selected = table.select(keep)
    df = selected if isinstance(selected, pl.DataFrame) else pl.from_arrow(selected, rechunk=False)
    assert isinstance(df, pl.DataFrame)
    ids = selected.column("comm_id") if isinstance(selected, pa.Table) else df.get_column("comm_id").to_arrow()
    df = df.with_columns(_comm=_codes(ids))
    if df.select((pl.col("op") == "compute").any()).item():
        df = df.filter(pl.col("op") != "compute")
    return df.with_row_index("_row")


def _codes(values: pa.ChunkedArray | pa.Array) -> pl.Series:
    """A dense integer code per distinct text (Arrow's hash encoding, far cheaper than polars' dense rank)."""
    if pa.types.is_string_view(values.type):
        values = values.cast(pa.large_string())
    encoded = pc.dictionary_encode(values)
    if isinstance(encoded, pa.ChunkedArray):
        if len({len(chunk.dictionary) for chunk in encoded.chunks}) > 1:
            encoded = encoded.unify_dictionaries()
        indices = pa.chunked_array([chunk.indices for chunk in encoded.chunks], pa.int32())
    else:
        indices = encoded.indices
    return pl.Series("_comm", indices, pl.Int32).cast(pl.Int64)


# Without a description, the name the communicator was created with (NCCL's commName, e.g. a
# Megatron group name) reads better than a hash; a name that only repeats the id adds nothing.
# Applied to per-communicator aggregates, not to every row.
DESC = (
    pl.when(
        pl.col("comm_desc").is_null() & pl.col("comm_name").is_not_null() & (pl.col("comm_name") != pl.col("comm_id"))
    )
    .then(pl.col("comm_name"))
    .otherwise(pl.col("comm_desc"))
    .alias("comm_desc")
)


_IS_STREAM = ~pl.col("is_p2p") & pl.col("seq").is_not_null() & pl.col("seq_kind").is_not_null()
_SOP = pl.when(pl.col("seq_kind") == "func").then(pl.col("op")).otherwise(pl.lit("")).alias("sop")
_TIME = pl.max_horizontal("enqueue_ns", "start_ns", "end_ns")


def split(df: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(collective rows with a sequence, every other row: P2P, progress rows without a sequence, ...)."""
    return df.filter(_IS_STREAM).with_columns(_SOP), df.filter(~_IS_STREAM)


def per_rank_streams(coll: pl.DataFrame) -> pl.DataFrame:
    """One pass over the collective rows: per (stream, rank) everything the analysis needs from them.

    Only plain max/min aggregations over precomputed columns, run by polars' streaming engine, which
    aggregates as it goes instead of materialising every precomputed column and per-group row lists
    first (a third of the time and a sixth of the memory at 2 M rows). Text that is constant per group
    (ids, descriptions, names) is not aggregated: each group's first row (the lowest ``_row``, rows
    being in table order) is looked up afterwards, which is what ``first()`` would give.
    """
    keys = ["comm_id", "seq_kind", "sop", "rank"]
    real = pl.col("op") != PROGRESS_OP
    # Grouping on four columns, two of them text, costs more than every aggregation below together.
    # When every row counts in one sequence kind (the usual case: one kind per source), a stream is
    # its communicator, and (communicator code, rank) packs into one integer key.
    group_keys: list[str | pl.Expr] = keys
    restore: list[pl.Expr] = []
    if not coll.is_empty():
        # One kind and op key in every row: compared with the first row's (cheaper than text min/max).
        kind, sop = coll.get_column("seq_kind")[0], coll.get_column("sop")[0]
        one_stream_per_comm = coll.select(
            ((pl.col("seq_kind") == kind) & (pl.col("sop") == sop)).all() & (pl.col("rank").min() >= 0)
        ).item()
        if one_stream_per_comm:
            group_keys = [(pl.col("_comm") * _RANK_SPAN + pl.col("rank").cast(pl.Int64)).alias("_key")]
            restore = [
                pl.lit(kind, pl.String).alias("seq_kind"),
                pl.lit(sop, pl.String).alias("sop"),
                (pl.col("_key") % _RANK_SPAN).cast(pl.Int32).alias("rank"),
                (pl.col("_key") // _RANK_SPAN).alias("_stream"),
            ]
    aggregated = (
        coll.lazy()
        .with_row_index("_at")
        .group_by(group_keys)
        .agg(
            pl.col("_at").min().alias("_first"),
            pl.col("seq").max().alias("entered"),
            # Completion is in order within a stream: the highest completed seq is a watermark.
            pl.when(pl.col("state") == "completed").then(pl.col("seq")).max().alias("watermark"),
            pl.when(real).then(_TIME.fill_null(NO_TIME)).max().alias("last_t"),
            # The latest recorded op of this stream (sources record in order); across streams the
            # rank's last op is the one from the stream with the latest time (rank_activity).
            pl.when(real).then(pl.col("_row")).max().alias("last_row"),
            pl.col("comm_size").max().alias("comm_size"),
            pl.when(real & (pl.col("state") != "completed")).then(pl.col("seq")).min().alias("first_open"),
        )
        .collect(engine="streaming")
    )
    # Constant per communicator: taken from the group's first row.
    text = ["comm_id", "comm_desc", "comm_name"] if restore else ["comm_desc", "comm_name"]
    first_rows = coll.select(text)[aggregated.get_column("_first")]
    per_rank = pl.concat([aggregated.drop("_first"), first_rows], how="horizontal")
    if restore:
        per_rank = per_rank.select(*keys[:1], *restore, pl.exclude("_key", *keys))
    else:
        # ``_stream``: an integer per stream, so that later joins need not compare text.
        streams = per_rank.select(keys[:3]).unique().with_row_index("_stream")
        per_rank = per_rank.join(streams.with_columns(pl.col("_stream").cast(pl.Int64)), on=keys[:3], how="left")
    # Abandoned operations are rare: counted over their own rows, not aggregated over all of them.
    abandoned = (
        coll.filter(pl.col("state") == "abandoned").group_by(keys).agg(pl.len().cast(pl.UInt32).alias("abandoned"))
    )
    if abandoned.is_empty():
        per_rank = per_rank.with_columns(pl.lit(0, pl.UInt32).alias("abandoned"))
    else:
        per_rank = per_rank.join(abandoned, on=keys, how="left").with_columns(pl.col("abandoned").fill_null(0))
    # Pending: not completed, above the watermark. The lowest open sequence is the first pending one
    # unless it lies at or below the watermark (a stale record of an operation that completed, as
    # sources that record an operation more than once leave): only those streams are scanned again.
    stale = (pl.col("first_open") <= pl.col("watermark")).fill_null(False)
    first_pending = pl.when(~stale).then(pl.col("first_open"))
    per_rank = per_rank.with_columns(first_pending.alias("first_pending"))
    rescan = per_rank.filter(stale).select(*keys, "watermark")
    if not rescan.is_empty():
        pending = (
            coll.filter((pl.col("state") != "completed") & real)
            .select(*keys, "seq")
            .join(rescan, on=keys, how="inner")
            .filter(pl.col("seq") > pl.col("watermark"))
            .group_by(keys)
            .agg(pl.col("seq").min().alias("rescanned"))
        )
        per_rank = (
            per_rank.join(pending, on=keys, how="left")
            .with_columns(
                pl.when(stale).then(pl.col("rescanned")).otherwise(pl.col("first_pending")).alias("first_pending")
            )
            .drop("rescanned")
        )
    return per_rank.drop("first_open").with_columns(
        pl.when(pl.col("last_t").is_not_null()).then(pl.col("last_row")).alias("last_row")
    )


def members_and_info(per_rank: pl.DataFrame, rest: pl.DataFrame, df: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(comm_id, rank) for every known member, and per-communicator description and size."""
    listed = (
        df.filter(pl.col("comm_ranks").is_not_null())
        .group_by("comm_id")
        .agg(pl.col("comm_ranks").first())
        .explode("comm_ranks")
        .rename({"comm_ranks": "rank"})
        .filter(pl.col("rank").is_not_null())
    )
    seen = pl.concat([per_rank.select("comm_id", "rank"), rest.select("comm_id", "rank")])
    columns = ("comm_id", "comm_desc", "comm_name", "comm_size")
    members = pl.concat([listed.select("comm_id", pl.col("rank").cast(pl.Int32)), seen]).unique()
    both = pl.concat([per_rank.select(*columns), rest.select(*columns)])
    # Each name's first non-null value, from its non-null rows (a plain first() stays vectorised, a
    # drop_nulls() inside the aggregation would run group by group).
    info = both.group_by("comm_id").agg(pl.col("comm_size").max())
    for name in ("comm_desc", "comm_name"):
        named = both.filter(pl.col(name).is_not_null()).group_by("comm_id").agg(pl.col(name).first())
        info = info.join(named, on="comm_id", how="left")
    info = info.select("comm_id", DESC, "comm_size")
    return members, info


def rank_activity(per_rank: pl.DataFrame, rest: pl.DataFrame) -> pl.DataFrame:
    """Per rank: latest timestamp (null when the source has none), abandoned ops, row of its last op."""
    real = rest.filter(pl.col("op") != PROGRESS_OP).select(
        "rank",
        _TIME.fill_null(NO_TIME).alias("last_t"),
        pl.col("_row").alias("last_row"),
        (pl.col("state") == "abandoned").cast(pl.UInt32).alias("abandoned"),
    )
    both = pl.concat(
        [per_rank.select("rank", "last_t", "last_row", pl.col("abandoned").cast(pl.UInt32)), real],
        how="vertical_relaxed",
    ).filter(pl.col("last_row").is_not_null())
    return (
        both.group_by("rank")
        .agg(
            pl.col("last_t").max().alias("last_t"),
            pl.col("last_row").filter(pl.col("last_t") == pl.col("last_t").max()).max().alias("last_row"),
            pl.col("abandoned").sum().alias("abandoned"),
        )
        .with_columns(pl.when(pl.col("last_t") > NO_TIME).then(pl.col("last_t")).alias("last_activity_ns"))
    )


def collective_streams(per_rank: pl.DataFrame, members: pl.DataFrame, evidence_ranks: list[int]) -> pl.DataFrame:
    """One row per (stream, member rank) with entered / watermark / first pending sequences."""
    streams = per_rank.select("_stream", "comm_id", "seq_kind", "sop").unique("_stream")
    grid = streams.join(members, on="comm_id", how="inner")
    out = grid.join(
        per_rank.select("_stream", "rank", "entered", "watermark", "first_pending"), on=["_stream", "rank"], how="left"
    )
    return out.with_columns(
        pl.col("entered").is_not_null().alias("has_rows"),
        # A member that left no evidence at all may have entered anything: it does not set the
        # blocking sequence, it is only reported missing at it.
        pl.col("rank").is_in(evidence_ranks).alias("has_evidence"),
        pl.col("entered").fill_null(_NONE),
        # The lowest sequence this rank has not completed.
        pl.coalesce(
            pl.col("first_pending"),
            pl.col("watermark") + 1,
            pl.col("entered") + 1,
        ).alias("next_incomplete"),
    )


def stuck_streams(grid: pl.DataFrame) -> pl.DataFrame:
    """Per stuck stream: blocking seq, its kind, and member lists (entered, missing, waiting, lagging).

    Grouped on the integer stream code; conditions are folded into the aggregated values (a filter
    inside an aggregation runs group by group), and the rows are sorted by rank once so that every
    member list comes out sorted (rows keep their order within a group).
    """
    key = "_stream"
    # A collective completes only once every member entered it: whatever one member completed,
    # all entered, even when a member's own record of it was lost (a process that crashed before
    # its last records were flushed, a ring that dropped them).
    done_by_any = pl.col("watermark").max().over(key).fill_null(_NONE)
    grid = grid.with_columns(pl.max_horizontal("entered", done_by_any).alias("entered"))
    with_rows = pl.when(pl.col("has_rows")).then(pl.col("next_incomplete"))
    stats = grid.group_by(key).agg(
        pl.col("first_pending").is_not_null().any().alias("stuck"),
        (pl.when(pl.col("has_evidence")).then(pl.col("entered")).min() + 1).alias("s_entry"),
        pl.col("entered").max().alias("max_entered"),
        with_rows.min().alias("s_complete"),
        with_rows.max().alias("max_incomplete"),
    )
    stats = stats.filter(pl.col("stuck"))
    stats = stats.with_columns(
        pl.when(pl.col("s_entry") <= pl.col("max_entered"))
        .then(pl.col("s_entry"))
        .otherwise(pl.col("s_complete"))
        .alias("seq"),
        (pl.col("max_incomplete") > pl.col("s_complete")).alias("has_laggards"),
    )
    joined = grid.join(stats.drop("stuck"), on=key, how="inner").sort("rank")
    entered_at = pl.col("entered") >= pl.col("seq")
    return (
        joined.group_by(key)
        .agg(
            pl.col("comm_id").first(),
            pl.col("seq_kind").first(),
            pl.col("sop").first(),
            pl.col("seq").first(),
            pl.col("s_complete").first(),
            (~entered_at).any().alias("has_missing"),
            pl.col("has_laggards").first(),
            pl.col("rank").filter(entered_at).alias("entered_ranks"),
            pl.col("rank").filter(~entered_at).alias("missing_ranks"),
            # Waiting at the blocking seq: entered it and not completed it.
            pl.col("rank").filter(entered_at & (pl.col("next_incomplete") <= pl.col("seq"))).alias("waiting"),
            # Lagging: entered the lowest incomplete seq that some peer completed, without completing it.
            pl.col("rank")
            .filter(
                pl.col("has_laggards")
                & pl.col("has_rows")
                & (pl.col("next_incomplete") == pl.col("s_complete"))
                & (pl.col("entered") >= pl.col("s_complete"))
            )
            .alias("lagging"),
            # Ranks pending at a later seq than the laggards: they wait for the laggards.
            pl.col("rank")
            .filter(
                pl.col("has_laggards")  # only read where some rank lags
                & pl.col("first_pending").is_not_null()
                & (pl.col("next_incomplete") > pl.col("s_complete"))
            )
            .alias("ahead"),
        )
        .drop(key)
    )


def open_rows(coll: pl.DataFrame, stuck: pl.DataFrame) -> pl.DataFrame:
    """The collective rows everything after the aggregation reads, in one scan: real operations not
    completed, and those at a sequence some stuck stream blocks at; ``at_block`` marks the rows at
    their own stream's blocking sequence. Usually a small part of the rows."""
    keys = ["comm_id", "seq_kind", "sop", "seq"]
    at_blocking = pl.col("seq").is_in(stuck.get_column("seq").unique().implode())
    near = coll.filter((pl.col("op") != PROGRESS_OP) & ((pl.col("state") != "completed") | at_blocking))
    blocking = stuck.select(*keys, pl.lit(True).alias("at_block"))  # one blocking seq per stream
    return near.join(blocking, on=keys, how="left").with_columns(pl.col("at_block").fill_null(False))


def ops_at(near: pl.DataFrame) -> pl.DataFrame:
    """Rows at each stuck stream's blocking seq (for its op, shape and dtype); ``near`` from open_rows."""
    return near.filter(pl.col("at_block"))


def representatives(at: pl.DataFrame) -> pl.DataFrame:
    """Per stuck stream: the op, shape and dtype at its blocking seq (``at``: ops_at), the most common
    among the ranks there (ties, e.g. all_to_all whose split sizes differ per rank, go to the lowest
    rank), and ``first_ns``, when the first rank entered it."""
    keys = ["comm_id", "seq_kind", "sop"]
    signature = ["op", "shape", "dtype"]
    modes = (
        at.group_by(*keys, *signature)
        .agg(pl.len().alias("n"), pl.col("rank").min().alias("low"))
        .sort(["n", "low"], descending=[True, False])
        .unique(keys, keep="first", maintain_order=True)
        .select(*keys, *signature)
    )
    times = at.group_by(keys).agg(pl.min_horizontal("enqueue_ns", "start_ns").min().alias("first_ns"))
    return modes.join(times, on=keys, how="left")


def mismatches(near: pl.DataFrame) -> pl.DataFrame:
    """(stream, seq) where ranks disagree on op, dtype or (for size-bound ops) element count.

    Checked where it can explain a hang: at sequences some rank has not completed and at each
    stuck stream's blocking sequence. Completed history is not re-checked (it is most of the data).
    ``near`` holds those rows and more (open_rows).
    """
    keys = ["comm_id", "seq_kind", "sop", "seq"]
    coll = near.filter((pl.col("state") != "completed") | pl.col("at_block"))
    # Cheap first pass over rows; the per-rank signatures below only for the flagged groups.
    # More than one distinct value <=> min != max (nulls ignored), without a hash set per group.
    rough = coll.group_by(keys).agg(
        *(
            (pl.col(name).min() != pl.col(name).max()).fill_null(False).alias(f"varies_{name}")
            for name in ("op", "dtype", "count", "rank")
        )
    )
    rough = rough.filter(
        pl.col("varies_rank") & (pl.col("varies_op") | pl.col("varies_dtype") | pl.col("varies_count"))
    )
    coll = coll.join(rough.select(keys), on=keys, how="semi")
    # One signature per rank and seq (coalesced groups may put several rows on one seq).
    per_rank = coll.group_by(*keys, "rank").agg(
        pl.col("op").sort().str.join(",").alias("op"),
        pl.col("dtype").drop_nulls().sort().str.join(",").alias("dtype"),
        pl.col("count").sum().alias("count"),
        pl.col("count").is_null().any().alias("count_unknown"),
    )
    grouped = per_rank.group_by(keys).agg(
        pl.col("op").n_unique().alias("n_op"),
        pl.col("dtype").filter(pl.col("dtype") != "").n_unique().alias("n_dtype"),
        pl.col("count").filter(~pl.col("count_unknown")).n_unique().alias("n_count"),
        pl.col("op").first().alias("first_op"),
        pl.len().alias("n_ranks"),
    )
    size_bound = ~pl.col("first_op").is_in(list(SIZE_FREE_OPS))
    flagged = grouped.filter(
        (pl.col("n_ranks") > 1)
        & ((pl.col("n_op") > 1) | (pl.col("n_dtype") > 1) | (size_bound & (pl.col("n_count") > 1)))
    )
    return flagged.join(per_rank, on=keys, how="inner")


_ORDER = pl.coalesce("enqueue_ns", "start_ns")  # program order of a rank's own operations, when timed


def pending_p2p(df: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(per (communicator, sender, receiver): pending sends vs pending receives; the pending P2P rows).

    A source may record one operation more than once (when it was enqueued, again when a timeout
    or finalize found it in flight): rows of one rank with the same (communicator, op, peer, seq)
    are one operation, pending only when none of them completed. Rows without a sequence are
    counted as they come.
    """
    ops_schema = {
        "rank": pl.Int32,
        "comm_id": pl.String,
        "op": pl.String,
        "peer": pl.Int32,
        "seq": pl.Int64,
        "t": pl.Int64,
        "record_id": pl.Int64,
        "src": pl.Int32,
        "dst": pl.Int32,
    }
    p2p = df.filter(pl.col("is_p2p"))
    if p2p.is_empty():
        counts = pl.DataFrame(
            schema={
                "comm_id": pl.String,
                "src": pl.Int32,
                "dst": pl.Int32,
                "sends": pl.UInt32,
                "recvs": pl.UInt32,
                "first_seq": pl.Int64,
                "t_send": pl.Int64,
                "rid_send": pl.Int64,
                "t_recv": pl.Int64,
                "rid_recv": pl.Int64,
            }
        )
        return counts, pl.DataFrame(schema=ops_schema)
    wm = (
        p2p.filter((pl.col("op") == PROGRESS_OP) & (pl.col("state") == "completed"))
        .group_by("comm_id", "rank")
        .agg(pl.col("seq").max().alias("watermark"))
    )
    keys = ["rank", "comm_id", "op", "peer", "seq"]
    rows = p2p.filter(pl.col("op").is_in(["send", "recv"]) & pl.col("peer").is_not_null()).select(
        *keys, "state", _ORDER.alias("t"), "record_id"
    )
    with_seq = (
        rows.filter(pl.col("seq").is_not_null())
        .group_by(keys)
        .agg(
            (pl.col("state") == "completed").any().alias("done"),
            pl.col("t").min(),
            pl.col("record_id").min(),
        )
        .filter(~pl.col("done"))
        .drop("done")
    )
    without_seq = rows.filter(pl.col("seq").is_null() & (pl.col("state") != "completed")).drop("state")
    ops = (
        pl.concat([with_seq, without_seq.select(with_seq.columns)], how="vertical_relaxed")
        .join(wm, on=["comm_id", "rank"], how="left")
        .filter(pl.col("watermark").is_null() | pl.col("seq").is_null() | (pl.col("seq") > pl.col("watermark")))
        .drop("watermark")
        .with_columns(
            pl.when(pl.col("op") == "send").then(pl.col("rank")).otherwise(pl.col("peer")).alias("src"),
            pl.when(pl.col("op") == "send").then(pl.col("peer")).otherwise(pl.col("rank")).alias("dst"),
        )
    )
    send, recv = pl.col("op") == "send", pl.col("op") == "recv"
    counts = ops.group_by("comm_id", "src", "dst").agg(
        send.sum().alias("sends"),
        recv.sum().alias("recvs"),
        pl.col("seq").min().alias("first_seq"),
        # Where each side's first pending operation of the pair sits in its own program order.
        pl.col("t").filter(send).min().alias("t_send"),
        pl.col("record_id").filter(send).min().alias("rid_send"),
        pl.col("t").filter(recv).min().alias("t_recv"),
        pl.col("record_id").filter(recv).min().alias("rid_recv"),
    )
    return counts, ops.select(list(ops_schema)).cast(ops_schema)  # type: ignore[arg-type]


def earliest_pending(
    near: pl.DataFrame, per_rank: pl.DataFrame, p2p_ops: pl.DataFrame, ranks: set[int]
) -> dict[int, dict]:
    """Per rank of ``ranks``, its first pending operation in its own program order (collective or P2P).

    Program order is the enqueue (else start) time; without times, the source's record id (Flight
    Recorder numbers a rank's entries in issue order). A rank whose pending rows carry neither is
    left out: nothing says which of its operations came first.
    """
    keys = ["comm_id", "seq_kind", "sop", "rank"]
    wanted = pl.col("rank").is_in(sorted(ranks))
    coll_pending = (
        near.filter((pl.col("state") != "completed") & wanted)  # near: open_rows
        .join(per_rank.select(*keys, "watermark"), on=keys, how="left")
        .filter(pl.col("watermark").is_null() | (pl.col("seq") > pl.col("watermark")))
        .select(*keys, "seq", "op", _ORDER.alias("t"), "record_id")
        .with_columns(pl.lit(None, pl.Int32).alias("peer"), pl.lit(False).alias("is_p2p"))
    )
    p2p_pending = p2p_ops.filter(wanted).select(
        "comm_id",
        pl.lit("p2p").alias("seq_kind"),
        pl.lit("").alias("sop"),
        "rank",
        "seq",
        "op",
        "t",
        "record_id",
        "peer",
        pl.lit(True).alias("is_p2p"),
    )
    pending = pl.concat([coll_pending, p2p_pending.select(coll_pending.columns)], how="vertical_relaxed")
    first = (
        pending.filter(pl.col("t").is_not_null() | pl.col("record_id").is_not_null())
        .sort(["rank", "t", "record_id"], nulls_last=True)
        .unique(subset="rank", keep="first", maintain_order=True)
    )
    return {int(row["rank"]): row for row in first.iter_rows(named=True)}


def rows(frame: pl.DataFrame, *names: str) -> Any:
    """The frame's rows as tuples of plain Python values, converted column by column (far cheaper than
    ``iter_rows``: no per-row dict, list columns arrive as lists of ints)."""
    return zip(*(frame.get_column(name).to_list() for name in names), strict=True)
