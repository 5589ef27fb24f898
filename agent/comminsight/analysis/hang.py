"""Hang and failure analysis: where did progress stop first, and which ranks should an engineer look at?

A pure function over the operations table (comminsight.evidence), vectorised with polars. The
method, with its rules and limits, is written up in docs/analysis-hang.md. In short:

1. Every collective *stream* - (communicator, seq_kind[, op when seq_kind is "func"]) - is
   reduced per member rank to: the highest sequence it entered, its completion watermark (the
   highest sequence it reported completed; completion is in order within a stream) and its
   lowest pending sequence. Members come from the communicator's member list when a source
   gives it, else from the ranks seen in it; a member with no rows has entered nothing.
2. A stream is stuck when some member has a pending operation. Its blocking sequence is the
   lowest one some member never entered (those members are *missing*); when every member
   entered everything, it is the lowest sequence not completed by every member.
3. P2P operations are matched per (communicator, sender, receiver) by counting pending sends
   against pending receives; the side with nothing to match waits on the other.
4. Waiting ranks point at the ranks they wait for; the ranks where progress stopped first are
   the sink components of that graph (a rank that waits on nobody, or a cycle such as a P2P
   deadlock). Ranks whose completions lag operations their peers completed (their GPU stopped)
   and the minority side of an op/size/dtype mismatch are root causes too.
5. Program order: each rank's first pending operation (by enqueue time, else record id). Inside
   a matched P2P pair or a collective everyone entered, a member still busy with an earlier
   operation is waited on by the others; a rank missing from a collective because it is blocked
   in an earlier operation waits on whoever blocks that one. Such ranks are waiters, not causes.

Only sequence counts are needed: sources without timing (Flight Recorder dumps with every entry
"scheduled") are analysed the same way; timing, when present, orders ranks by last progress.
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Any

import polars as pl
import pyarrow as pa

from comminsight.evidence import PROGRESS_OP
from comminsight.importers.columns import paused_gc
from comminsight.importers.normalise import shape_display

# Ops whose per-rank sizes legitimately differ (uneven splits), so only op and dtype are compared.
_SIZE_FREE_OPS = ("all_to_all", "gather", "scatter", "coalesced", "other", "barrier")
_MAX_LISTED = 64  # cap on rank lists inside one evidence item, so 16k-rank reports stay readable
_NONE = -1
_NO_TIME = -(2**63)  # below any timestamp; stands for "no time" inside aggregations


def _frame(table: pa.Table | pl.DataFrame) -> pl.DataFrame:
    keep = [
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
    ]
    # Only the columns used here cross from Arrow to polars, without re-chunking.
    selected = table.select(keep)
    df = selected if isinstance(selected, pl.DataFrame) else pl.from_arrow(selected, rechunk=False)
    assert isinstance(df, pl.DataFrame)
    return df.filter(pl.col("op") != "compute").with_row_index("_row")


# Without a description, the name the communicator was created with (NCCL's commName, e.g. a
# Megatron group name) reads better than a hash; a name that only repeats the id adds nothing.
# Applied to per-communicator aggregates, not to every row.
_DESC = (
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


def _split(df: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(collective rows with a sequence, every other row: P2P, progress rows without a sequence, ...)."""
    return df.filter(_IS_STREAM).with_columns(_SOP), df.filter(~_IS_STREAM)


def _per_rank_streams(coll: pl.DataFrame) -> pl.DataFrame:
    """One pass over the collective rows: per (stream, rank) everything the analysis needs from them.

    Only plain max/min/sum aggregations over precomputed columns, so polars runs them vectorised
    (a filter inside an aggregation would be evaluated group by group).
    """
    keys = ["comm_id", "seq_kind", "sop", "rank"]
    real = pl.col("op") != PROGRESS_OP
    per_rank = (
        coll.select(
            *keys,
            "seq",
            pl.when(pl.col("state") == "completed").then(pl.col("seq")).alias("seq_done"),
            pl.when(real).then(_TIME.fill_null(_NO_TIME)).alias("t_real"),
            (pl.col("state") == "abandoned").alias("abandoned"),
            "comm_desc",
            "comm_name",
            "comm_size",
            pl.when(real).then(pl.col("_row")).alias("real_row"),
            pl.when(real & (pl.col("state") != "completed")).then(pl.col("seq")).alias("seq_open"),
        )
        .group_by(keys)
        .agg(
            pl.col("seq").max().alias("entered"),
            # Completion is in order within a stream: the highest completed seq is a watermark.
            pl.col("seq_done").max().alias("watermark"),
            pl.col("t_real").max().alias("last_t"),
            # The latest recorded op of this stream (sources record in order); across streams the
            # rank's last op is the one from the stream with the latest time (_rank_activity).
            pl.col("real_row").max().alias("last_row"),
            pl.col("abandoned").sum().alias("abandoned"),
            # Constant per communicator; first() keeps the aggregation on polars' fast path.
            pl.col("comm_desc").first().alias("comm_desc"),
            pl.col("comm_name").first().alias("comm_name"),
            pl.col("comm_size").max().alias("comm_size"),
            pl.col("seq_open").min().alias("first_open"),
        )
    )
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


def _members(per_rank: pl.DataFrame, rest: pl.DataFrame, df: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
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
    info = (
        pl.concat([per_rank.select(*columns), rest.select(*columns)])
        .group_by("comm_id")
        .agg(
            pl.col("comm_desc").drop_nulls().first().alias("comm_desc"),
            pl.col("comm_name").drop_nulls().first().alias("comm_name"),
            pl.col("comm_size").max().alias("comm_size"),
        )
        .select("comm_id", _DESC, "comm_size")
    )
    return members, info


def _rank_activity(per_rank: pl.DataFrame, rest: pl.DataFrame) -> pl.DataFrame:
    """Per rank: latest timestamp (null when the source has none), abandoned ops, row of its last op."""
    real = rest.filter(pl.col("op") != PROGRESS_OP).select(
        "rank",
        _TIME.fill_null(_NO_TIME).alias("last_t"),
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
        .with_columns(pl.when(pl.col("last_t") > _NO_TIME).then(pl.col("last_t")).alias("last_activity_ns"))
    )


def _collective_streams(per_rank: pl.DataFrame, members: pl.DataFrame, evidence_ranks: list[int]) -> pl.DataFrame:
    """One row per (stream, member rank) with entered / watermark / first pending sequences."""
    streams = per_rank.select("comm_id", "seq_kind", "sop").unique()
    grid = streams.join(members, on="comm_id", how="inner")
    out = grid.join(
        per_rank.select("comm_id", "seq_kind", "sop", "rank", "entered", "watermark", "first_pending"),
        on=["comm_id", "seq_kind", "sop", "rank"],
        how="left",
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


def _stuck_streams(grid: pl.DataFrame) -> pl.DataFrame:
    """Per stuck stream: blocking seq, its kind, and member lists (entered, missing, waiting, lagging)."""
    keys = ["comm_id", "seq_kind", "sop"]
    # A collective completes only once every member entered it: whatever one member completed,
    # all entered, even when a member's own record of it was lost (a process that crashed before
    # its last records were flushed, a ring that dropped them).
    done_by_any = pl.col("watermark").max().over(keys).fill_null(_NONE)
    grid = grid.with_columns(pl.max_horizontal("entered", done_by_any).alias("entered"))
    stats = grid.group_by(keys).agg(
        pl.col("first_pending").is_not_null().any().alias("stuck"),
        (pl.col("entered").filter(pl.col("has_evidence")).min() + 1).alias("s_entry"),
        pl.col("entered").max().alias("max_entered"),
        pl.col("next_incomplete").filter(pl.col("has_rows")).min().alias("s_complete"),
        pl.col("next_incomplete").filter(pl.col("has_rows")).max().alias("max_incomplete"),
    )
    stats = stats.filter(pl.col("stuck"))
    stats = stats.with_columns(
        pl.when(pl.col("s_entry") <= pl.col("max_entered"))
        .then(pl.col("s_entry"))
        .otherwise(pl.col("s_complete"))
        .alias("seq"),
        (pl.col("max_incomplete") > pl.col("s_complete")).alias("has_laggards"),
    )
    joined = grid.join(stats, on=keys, how="inner")
    entered_at = pl.col("entered") >= pl.col("seq")
    return joined.group_by(keys).agg(
        pl.col("seq").first(),
        pl.col("s_complete").first(),
        (~entered_at).any().alias("has_missing"),
        pl.col("has_laggards").first(),
        pl.col("rank").filter(entered_at).sort().alias("entered_ranks"),
        pl.col("rank").filter(~entered_at).sort().alias("missing_ranks"),
        # Waiting at the blocking seq: entered it and not completed it.
        pl.col("rank").filter(entered_at & (pl.col("next_incomplete") <= pl.col("seq"))).sort().alias("waiting"),
        # Lagging: entered the lowest incomplete seq that some peer completed, without completing it.
        pl.col("rank")
        .filter(
            pl.col("has_laggards")
            & pl.col("has_rows")
            & (pl.col("next_incomplete") == pl.col("s_complete"))
            & (pl.col("entered") >= pl.col("s_complete"))
        )
        .sort()
        .alias("lagging"),
        # Ranks pending at a later seq than the laggards: they wait for the laggards.
        pl.col("rank")
        .filter(
            pl.col("has_laggards")  # only read where some rank lags
            & pl.col("first_pending").is_not_null()
            & (pl.col("next_incomplete") > pl.col("s_complete"))
        )
        .sort()
        .alias("ahead"),
    )


def _ops_at(coll: pl.DataFrame, stuck: pl.DataFrame) -> pl.DataFrame:
    """Rows at each stuck stream's blocking seq (for its op, shape and dtype)."""
    keys = ["comm_id", "seq_kind", "sop", "seq"]
    real = coll.filter(pl.col("seq").is_in(stuck.get_column("seq").unique().implode()) & (pl.col("op") != PROGRESS_OP))
    return real.join(stuck.select(keys), on=keys, how="semi")


def _mismatches(coll: pl.DataFrame, at: pl.DataFrame) -> pl.DataFrame:
    """(stream, seq) where ranks disagree on op, dtype or (for size-bound ops) element count.

    Checked where it can explain a hang: at sequences some rank has not completed and at each
    stuck stream's blocking sequence. Completed history is not re-checked (it is most of the data).
    """
    keys = ["comm_id", "seq_kind", "sop", "seq"]
    pending = coll.filter((pl.col("state") != "completed") & (pl.col("op") != PROGRESS_OP))
    candidates = pl.concat([pending.select(keys), at.select(keys)]).unique()
    coll = pl.concat([pending, at]).unique(subset=["_row"]).join(candidates, on=keys, how="semi")
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
    size_bound = ~pl.col("first_op").is_in(list(_SIZE_FREE_OPS))
    flagged = grouped.filter(
        (pl.col("n_ranks") > 1)
        & ((pl.col("n_op") > 1) | (pl.col("n_dtype") > 1) | (size_bound & (pl.col("n_count") > 1)))
    )
    return flagged.join(per_rank, on=keys, how="inner")


_ORDER = pl.coalesce("enqueue_ns", "start_ns")  # program order of a rank's own operations, when timed


def _p2p(df: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
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


def _earliest_pending(
    coll: pl.DataFrame, per_rank: pl.DataFrame, p2p_ops: pl.DataFrame, ranks: set[int]
) -> dict[int, dict]:
    """Per rank of ``ranks``, its first pending operation in its own program order (collective or P2P).

    Program order is the enqueue (else start) time; without times, the source's record id (Flight
    Recorder numbers a rank's entries in issue order). A rank whose pending rows carry neither is
    left out: nothing says which of its operations came first.
    """
    keys = ["comm_id", "seq_kind", "sop", "rank"]
    wanted = pl.col("rank").is_in(sorted(ranks))
    coll_pending = (
        coll.filter((pl.col("state") != "completed") & (pl.col("op") != PROGRESS_OP) & wanted)
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


def _order_key(t: int | None, record_id: int | None) -> tuple[float, float]:
    return (t if t is not None else float("inf"), record_id if record_id is not None else float("inf"))


def _blocked_earlier(first: dict | None, t: int | None, record_id: int | None, p2p_comm: str | None = None) -> bool:
    """Whether a rank's first pending operation ``first`` comes before its operation at (t, record_id).

    Then the rank's stream has not reached that operation: it is blocked in an earlier one. P2P
    operations on the same communicator are treated as one batch (1F1B posts a send and a receive
    together), never as blocking each other.
    """
    if first is None or (t is None and record_id is None):
        return False
    if p2p_comm is not None and first["is_p2p"] and first["comm_id"] == p2p_comm:
        return False
    return _order_key(first["t"], first["record_id"]) < _order_key(t, record_id)


def _sink_components(edges: dict[int, set[int]], nodes: set[int]) -> list[set[int]]:
    """Strongly connected components of the graph on ``nodes`` with no edge leaving them (Tarjan, iterative)."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    on_stack: set[int] = set()
    stack: list[int] = []
    components: list[set[int]] = []
    counter = 0
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, set()) & nodes)))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            advanced = False
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = counter
                    counter += 1
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(edges.get(succ, set()) & nodes))))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                components.append(component)
    sinks = []
    for component in components:
        leaves = any((edges.get(n, set()) & nodes) - component for n in component)
        if not leaves:
            sinks.append(component)
    return sinks


def _chain(roots: list[int], edges: dict[int, set[int]], blocked_by: dict[int, list[dict]]) -> list[dict[str, Any]]:
    """From each root cause outwards (breadth first): the groups a rank blocks and who waits there.

    ``waits_on`` is the rank one step closer to the root cause through which the rank was reached
    (null for a root cause), so every entry's path to its root can be read back.
    """
    chain: list[dict[str, Any]] = []
    depth = dict.fromkeys(roots, 0)
    parent: dict[int, int | None] = dict.fromkeys(roots)
    queue = deque(roots)
    reverse: dict[int, set[int]] = defaultdict(set)
    for waiter, blockers in edges.items():
        for blocker in blockers:
            reverse[blocker].add(waiter)
    while queue and len(chain) < 256:
        rank = queue.popleft()
        blocks = [
            {
                "group_id": g["group_id"],
                "group_desc": g["group_desc"],
                "op": g["op"],
                "seq": g["seq"],
                "kind": g["kind"],
                "waiting_ranks": [w for w in g["waiting_ranks"] if w != rank][:_MAX_LISTED],
            }
            for g in blocked_by.get(rank, [])
        ]
        chain.append({"rank": rank, "depth": depth[rank], "waits_on": parent[rank], "blocks": blocks})
        # Only waiters that block somebody themselves extend the chain.
        for waiter in sorted(reverse.get(rank, ())):
            if waiter not in depth and waiter in blocked_by:
                depth[waiter] = depth[rank] + 1
                parent[waiter] = rank
                queue.append(waiter)
    return chain


def _wait_paths(chain: list[dict[str, Any]], limit: int = 16) -> list[list[int]]:
    """Paths from the outermost chain entries to their root cause (each rank waits on the next), longest first."""
    via = {link["rank"]: link["waits_on"] for link in chain}
    inner = {w for w in via.values() if w is not None}
    paths = []
    for link in chain:
        if link["rank"] in inner:
            continue
        path = [link["rank"]]
        while via.get(path[-1]) is not None:
            path.append(via[path[-1]])
        paths.append(path)
    paths.sort(key=lambda p: (-len(p), p))
    return paths[:limit]


def _rows(frame: pl.DataFrame, *names: str) -> Any:
    """The frame's rows as tuples of plain Python values, converted column by column (far cheaper than
    ``iter_rows``: no per-row dict, list columns arrive as lists of ints)."""
    return zip(*(frame.get_column(name).to_list() for name in names), strict=True)


def analyze_hang(table: pa.Table | pl.DataFrame, *, silence_s: float = 60.0) -> dict[str, Any]:
    """Analyse an operations table for a hang; returns a JSON-ready report.

    Keys: ``verdict`` ("hang", "no_hang", "insufficient_evidence"), ``root_cause_ranks`` (ranks
    to look at first, most likely first), ``stuck_groups`` (per stuck communicator: group_id,
    group_desc, op, seq, shape, dtype, entered_ranks, missing_ranks, plus kind, waiting_ranks and
    lagging_ranks), ``chain`` (from the root-cause ranks outwards: who they block, where),
    ``mismatches``, ``failures`` (ranks without evidence, ranks that stopped reporting, abandoned
    operations, ranks whose completions stalled), ``evidence`` (per rank, keyed by rank as text)
    and ``summary`` (one sentence).
    """
    # The report of a 16k-rank hang is a million small lists and dicts without cycles: collections
    # triggered while it is built would walk all of it again and again.
    with paused_gc():
        return _analyze(table, silence_s)


def _analyze(table: pa.Table | pl.DataFrame, silence_s: float) -> dict[str, Any]:
    df = _frame(table)
    report: dict[str, Any] = {
        "verdict": "insufficient_evidence",
        "root_cause_ranks": [],
        "stuck_groups": [],
        "chain": [],
        "wait_paths": [],
        "mismatches": [],
        "failures": {},
        "evidence": {},
        "summary": "",
    }
    if df.is_empty():
        report["summary"] = "No operations in the evidence."
        return report

    coll, rest = _split(df)
    per_rank = _per_rank_streams(coll)
    members, info = _members(per_rank, rest, df)
    evidence_ranks = set(pl.concat([per_rank.get_column("rank"), rest.get_column("rank")]).unique().to_list())
    world = set(members.get_column("rank").unique().to_list()) | evidence_ranks
    no_evidence = sorted(world - evidence_ranks)
    activity = _rank_activity(per_rank, rest)
    last_ns = dict(zip(activity["rank"].to_list(), activity["last_activity_ns"].to_list(), strict=True))
    desc_of = {c: d for c, d, _ in info.iter_rows()}

    grid = _collective_streams(per_rank, members, sorted(evidence_ranks))
    stuck = _stuck_streams(grid)
    at = _ops_at(coll, stuck)
    mism = _mismatches(coll, at)
    p2p, p2p_ops = _p2p(rest)

    # Representative op/shape/dtype at each blocking seq: the most common among the ranks there.
    # Ties (e.g. all_to_all, whose split sizes differ per rank) go to the lowest rank.
    rep: dict[tuple, dict] = {}
    first_ns: dict[tuple, int] = {}
    if not at.is_empty():
        modes = at.group_by("comm_id", "seq_kind", "sop", "op", "shape", "dtype").agg(
            pl.len().alias("n"), pl.col("rank").min().alias("low")
        )
        keys = ["comm_id", "seq_kind", "sop"]
        modes = modes.sort(["n", "low"], descending=[True, False]).unique(keys, keep="first", maintain_order=True)
        rep = {
            (c, k, o): {"op": op, "shape": shape, "dtype": dtype}
            for c, k, o, op, shape, dtype in _rows(modes, *keys, "op", "shape", "dtype")
        }
        times = at.group_by(keys).agg(pl.min_horizontal("enqueue_ns", "start_ns").min().alias("t"))
        first_ns = {(c, k, o): t for c, k, o, t in _rows(times, *keys, "t") if t is not None}

    mismatch_at: dict[tuple, dict] = {}
    mismatches = []
    if not mism.is_empty():
        for key, rows in mism.sort("seq", "rank").group_by(["comm_id", "seq_kind", "sop", "seq"], maintain_order=True):
            comm_id, seq_kind, sop, seq = key
            item = {"group_id": comm_id, "group_desc": desc_of.get(comm_id), "seq": int(seq), "fields": {}}
            minority: set[int] = set()
            for field in ("op", "dtype", "count"):
                by_value: dict[str, list[int]] = defaultdict(list)
                for rank, value in rows.select("rank", field).iter_rows():
                    if value is not None and value != "":
                        by_value[str(value)].append(int(rank))
                if len(by_value) > 1:
                    item["fields"][field] = {k: v[:_MAX_LISTED] for k, v in by_value.items()}
                    largest = max(len(v) for v in by_value.values())
                    majority = [k for k, v in by_value.items() if len(v) == largest]
                    if len(majority) == 1:
                        minority.update(r for k, v in by_value.items() if k != majority[0] for r in v)
                    else:
                        minority.update(r for v in by_value.values() for r in v)
            if not item["fields"]:
                continue
            item["ranks"] = sorted(minority)
            mismatches.append(item)
            mismatch_at[(comm_id, seq_kind, sop, int(seq))] = item
            if len(mismatches) >= 100:
                break

    edges: dict[int, set[int]] = defaultdict(set)
    blocked_by: dict[int, list[dict]] = defaultdict(list)
    waiting_in: dict[int, list[str]] = defaultdict(list)
    missing_from: dict[int, list[str]] = defaultdict(list)
    lagging_in: dict[int, list[str]] = defaultdict(list)
    mismatch_roots: list[int] = []
    stuck_groups = []
    # Which stuck group each pending operation belongs to, and whom that group waits for: a rank
    # blocked in its first pending operation waits for that group's blockers ("missing because
    # blocked earlier", below).
    group_of: dict[tuple, dict] = {}
    blockers_of: dict[int, list[int]] = {}

    stuck_rows = _rows(
        stuck.sort("comm_id", "seq_kind", "sop"),
        "comm_id",
        "seq_kind",
        "sop",
        "seq",
        "s_complete",
        "has_missing",
        "entered_ranks",
        "missing_ranks",
        "waiting",
        "lagging",
        "ahead",
    )
    for comm_id, seq_kind, sop, seq, s_complete, has_missing, entered, missing, waiting, lagging, ahead in stuck_rows:
        key = (comm_id, seq_kind, sop)
        info_row = rep.get(key, {})
        mismatch = mismatch_at.get((*key, seq)) or mismatch_at.get((*key, s_complete or -1))
        if mismatch:
            kind = "mismatch"
            mismatch_roots.extend(mismatch["ranks"])
        elif has_missing:
            kind = "missing_ranks"
        elif lagging:
            kind = "lagging_ranks"
        else:
            kind = "all_inside"
        if mismatch and len(mismatch["ranks"]) < len(entered):
            # Ranks that called the majority op wait for the ones that called something else.
            blockers = [r for r in mismatch["ranks"] if r in entered]
            waiters = [r for r in entered if r not in blockers]
        elif has_missing:
            blockers, waiters = missing, waiting
        elif lagging:
            blockers, waiters = lagging, [r for r in ahead if r not in lagging]
        else:
            blockers, waiters = [], []
        group = {
            "group_id": comm_id,
            "group_desc": desc_of.get(comm_id),
            "op": info_row.get("op") or (sop or None),
            "seq": seq,
            "seq_kind": seq_kind,
            "shape": info_row.get("shape"),
            "dtype": info_row.get("dtype"),
            "entered_ranks": entered,
            "missing_ranks": missing,
            "kind": kind,
            "waiting_ranks": waiting,
            "lagging_ranks": lagging,
            "lowest_incomplete_seq": s_complete,
            "first_entered_ns": first_ns.get(key),
        }
        if mismatch:
            group["mismatch"] = mismatch["fields"]
        stuck_groups.append(group)
        for r in lagging:
            lagging_in[r].append(comm_id)
        for r in missing:
            missing_from[r].append(comm_id)
        for r in waiting:
            waiting_in[r].append(comm_id)
        group_of[key] = group
        blockers_of[id(group)] = blockers
        for b in blockers:
            blocked_by[b].append(group)
            for w in waiters:
                if w != b:
                    edges[w].add(b)

    # Program order matters only for the ranks others wait for and the ranks in pending P2P pairs.
    needed = set(blocked_by) | set(p2p_ops.get_column("rank").unique().to_list())
    first_pending = _earliest_pending(coll, per_rank, p2p_ops, needed)

    for row in p2p.iter_rows(named=True):
        sends, recvs = int(row["sends"]), int(row["recvs"])
        if sends == recvs == 0:
            continue
        src, dst = int(row["src"]), int(row["dst"])
        waiter: int | None
        blocker: int | None
        if sends > recvs:
            waiter, blocker, op = src, dst, "send"
        elif recvs > sends:
            waiter, blocker, op = dst, src, "recv"
        else:
            waiter, blocker, op = None, None, "send/recv"
        kind = "p2p_unmatched" if blocker is not None else "p2p_inside"
        late: list[int] = []
        if blocker is None and sends:
            # Both sides posted. A side whose stream is still busy with an earlier operation has not
            # reached its part yet: the other side waits for it.
            comm = row["comm_id"]
            late = [
                r
                for r, t, rid in ((src, row["t_send"], row["rid_send"]), (dst, row["t_recv"], row["rid_recv"]))
                if _blocked_earlier(first_pending.get(r), t, rid, p2p_comm=comm)
            ]
            if len(late) == 1:
                blocker = late[0]
                waiter = dst if blocker == src else src
            else:
                late = []
        if waiter is not None and waiter in lagging_in:
            # The waiter's own completions stalled (its GPU stopped), so its pending P2P ops may well
            # have completed on the peer: they are no evidence against the peer.
            kind, blocker = "p2p_waiter_stalled", None
        group = {
            "group_id": row["comm_id"],
            "group_desc": desc_of.get(row["comm_id"]),
            "op": op,
            "seq": int(row["first_seq"]) if row["first_seq"] is not None else None,
            "seq_kind": "p2p",
            "shape": None,
            "dtype": None,
            "entered_ranks": sorted({src, dst} - ({blocker} if blocker is not None and not late else set())),
            "missing_ranks": [blocker] if blocker is not None and not late else [],
            "kind": kind,
            "waiting_ranks": [waiter] if waiter is not None else [src, dst],
            "lagging_ranks": [],
            "lowest_incomplete_seq": None,
            "first_entered_ns": None,
            "pending_sends": sends,
            "pending_recvs": recvs,
            "src": src,
            "dst": dst,
        }
        if late:
            group["blocked_earlier_ranks"] = late
        stuck_groups.append(group)
        group_of[(row["comm_id"], src, dst)] = group
        blockers_of[id(group)] = [blocker] if blocker is not None else []
        if blocker is not None and waiter is not None:
            edges[waiter].add(blocker)
            blocked_by[blocker].append(group)
            if not late:
                missing_from[blocker].append(row["comm_id"])
            waiting_in[waiter].append(row["comm_id"])

    # Missing because blocked earlier: a rank that others wait for but that is itself inside an
    # earlier pending operation (its own program order) is not where progress stopped; it waits
    # for whoever blocks that operation.
    for r in sorted(blocked_by):
        first = first_pending.get(r)
        if first is None:
            continue
        if first["is_p2p"]:
            pair = (r, first["peer"]) if first["op"] == "send" else (first["peer"], r)
            target = group_of.get((first["comm_id"], *pair))
        else:
            target = group_of.get((first["comm_id"], first["seq_kind"], first["sop"]))
        if target is None:
            continue
        for b in blockers_of.get(id(target), []):
            if b != r:
                edges[r].add(b)

    # Root causes: the sink components among the ranks somebody waits for.
    blockers_all = set(blocked_by)
    sinks = _sink_components(edges, blockers_all) if blockers_all else []

    def progress_key(rank: int) -> tuple:
        t = last_ns.get(rank)
        return (rank in evidence_ranks, t if t is not None else float("inf"), rank)

    roots: list[int] = []
    for r in dict.fromkeys(mismatch_roots):
        roots.append(r)
    for component in sorted(sinks, key=lambda c: min(progress_key(r) for r in c)):
        for r in sorted(component, key=progress_key):
            if r not in roots:
                roots.append(r)
    stalled = sorted(lagging_in, key=lambda r: (-len(lagging_in[r]), progress_key(r)))
    for r in stalled:
        if r not in roots:
            roots.append(r)
    has_stuck = bool(stuck_groups)
    if has_stuck and not roots:
        # Everyone is inside the same operations: fall back on the ranks whose last progress is earliest.
        pending = sorted({r for g in stuck_groups for r in g["waiting_ranks"]})
        timed = [r for r in pending if last_ns.get(r) is not None]
        if timed:
            earliest = min(last_ns[r] for r in timed)
            roots = [r for r in timed if last_ns[r] == earliest]

    latest = max((t for t in last_ns.values() if t is not None), default=None)
    stopped = []
    if latest is not None:
        gap = int(silence_s * 1e9)
        stopped = sorted(r for r, t in last_ns.items() if t is not None and latest - t > gap)
    with_abandoned = activity.filter(pl.col("abandoned") > 0)
    abandoned = dict(
        zip(map(str, with_abandoned["rank"].to_list()), with_abandoned["abandoned"].to_list(), strict=True)
    )
    if abandoned:
        # Peers that were still alive when the job was aborted recorded their in-flight operations
        # as abandoned. A rank they wait for that recorded no abandonment and whose evidence ends
        # before theirs did not go on reporting to the end: it crashed, was killed, or is stuck
        # outside communication (the operations table alone cannot tell these apart).
        alive_until = max((last_ns.get(int(r)) or _NO_TIME) for r in abandoned)
        stopped = sorted(
            set(stopped)
            | {
                r
                for r in missing_from
                if str(r) not in abandoned and last_ns.get(r) is not None and last_ns[r] < alive_until
            }
        )

    chain = _chain(roots, edges, blocked_by)

    # Per-rank evidence.
    last_ops = df.select("rank", "comm_id", "comm_desc", "comm_name", "op", "seq", "state", "shape", "dtype")[
        activity.get_column("last_row").to_list()
    ].with_columns(_DESC)
    evidence: dict[str, dict] = {}
    root_set = set(roots)
    fields = ("group_id", "group_desc", "op", "seq", "state", "shape", "dtype")
    columns = ("comm_id", "comm_desc", "op", "seq", "state", "shape", "dtype")
    for r, *values in zip(*(last_ops[c].to_list() for c in ("rank", *columns)), strict=True):
        evidence[str(r)] = {"last_op": dict(zip(fields, values, strict=True))}
    for r in sorted(world):
        item = evidence.setdefault(str(r), {"last_op": None})
        if r in root_set:
            status = "root_cause"
        elif r in no_evidence:
            status = "no_evidence"
        elif r in missing_from:
            status = "missing"
        elif r in waiting_in:
            status = "waiting"
        else:
            status = "idle"
        item["status"] = status
        item["last_activity_ns"] = last_ns.get(r)
        if r in missing_from:
            item["missing_from"] = sorted(set(missing_from[r]))[:_MAX_LISTED]
        if r in waiting_in:
            item["waiting_in"] = sorted(set(waiting_in[r]))[:_MAX_LISTED]
        if r in lagging_in:
            item["completions_lag_in"] = sorted(set(lagging_in[r]))[:_MAX_LISTED]
        first = first_pending.get(r)
        if first is not None:
            item["first_pending"] = {
                "group_id": first["comm_id"],
                "group_desc": desc_of.get(first["comm_id"]),
                "op": first["op"],
                "seq": first["seq"],
                "peer": first["peer"],
            }
        if edges.get(r):
            item["waits_on"] = sorted(edges[r])[:_MAX_LISTED]
        if str(r) in abandoned:
            item["abandoned_ops"] = abandoned[str(r)]

    order = {"mismatch": 0, "missing_ranks": 1, "p2p_unmatched": 2, "lagging_ranks": 3, "p2p_inside": 4}

    # Within a kind, the group where ranks were first seen entering comes first: that is where
    # progress diverged earliest.
    def blocked_by_root(group: dict) -> bool:
        blockers = group["missing_ranks"] + group["lagging_ranks"] + group.get("blocked_earlier_ranks", [])
        return bool(root_set.intersection(blockers))

    # Within a kind, the groups the root causes block first (the others are knock-on effects).
    stuck_groups.sort(
        key=lambda g: (
            order.get(g["kind"], 5),
            not blocked_by_root(g),
            g["first_entered_ns"] if g["first_entered_ns"] is not None else float("inf"),
            -len(g["missing_ranks"]),
            str(g["group_id"]),
            g["seq"] if g["seq"] is not None else 0,
        )
    )

    if has_stuck:
        verdict = "hang"
    elif no_evidence or (activity.is_empty() and df.get_column("seq").null_count() == df.height):
        # Ranks without evidence, or neither an operation nor a progress counter (only membership
        # rows): nothing says whether the job moved on.
        verdict = "insufficient_evidence"
    else:
        verdict = "no_hang"
    report.update(
        verdict=verdict,
        root_cause_ranks=roots,
        stuck_groups=stuck_groups,
        chain=chain,
        wait_paths=_wait_paths(chain),
        mismatches=mismatches,
        failures={
            "no_evidence_ranks": no_evidence,
            "stopped_reporting_ranks": stopped,
            "abandoned_ops": abandoned,
            "stalled_completion_ranks": stalled,
        },
        evidence=evidence,
        summary=_summary(verdict, roots, stuck_groups, no_evidence, len(world)),
    )
    return report


def _summary(verdict: str, roots: list[int], groups: list[dict], no_evidence: list[int], n_world: int) -> str:
    if verdict == "no_hang":
        return f"No hang: every operation entered by the {n_world} ranks in the evidence completed."
    if verdict == "insufficient_evidence" and not no_evidence:
        return "No operations or progress counters in the evidence, only group membership."
    if verdict == "insufficient_evidence":
        return f"No stuck operation seen, but {len(no_evidence)} member rank(s) left no evidence: " + ", ".join(
            map(str, no_evidence[:16])
        )
    first = groups[0]
    where = f"{first['group_desc'] or first['group_id']} {first['op']} seq {first['seq']}"
    shape = shape_display(first.get("shape"))
    if shape:
        where += f" ({shape} {first.get('dtype') or ''})".rstrip()
    if roots:
        who = ", ".join(map(str, roots[:16]))
        return f"Hang: progress stopped first at rank(s) {who}; first stuck group {where}."
    return f"Hang: {len(groups)} stuck group(s), first {where}; no single rank stands out."
