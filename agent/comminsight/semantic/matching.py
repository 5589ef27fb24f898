"""Matching of communication operations across ranks: one home for the step engine and the analyses.

Each collective is matched across its members by (communicator, op, seq); point-to-point
operations by (communicator, sender, receiver, n-th transfer) when peers are known, else by
completion time (a send and its receive finish together). Per member: arrival (start, else
enqueue), lateness (arrival minus the earliest member's) and waiting (time inside the operation
before the last member arrived).
"""

from __future__ import annotations

import polars as pl

P2P_WINDOW_NS = 2_000_000  # a receive ends within this of its send handing over


def _pair_p2p(p2p: pl.DataFrame) -> pl.DataFrame:
    """recv row -> send row (``partner_row``) for point-to-point events.

    With peers: the n-th send from a to b pairs with the n-th receive on b from a. Without peers:
    a receive completes when its send has handed the data over, so it pairs with the send on
    another rank of the same communicator whose end is nearest to its own (within P2P_WINDOW_NS;
    nearest, not last before: clocks of different hosts disagree by more than the hand-over).
    """
    with_peer = p2p.filter(pl.col("peer").is_not_null()).with_columns(
        sender=pl.when(pl.col("op") == "send").then(pl.col("rank")).otherwise(pl.col("peer")),
        receiver=pl.when(pl.col("op") == "send").then(pl.col("peer")).otherwise(pl.col("rank")),
    )
    with_peer = with_peer.with_columns(
        k=pl.col("arrival_ns").rank("ordinal").over("comm_id", "sender", "receiver", "op")
    )
    keys = ["comm_id", "sender", "receiver", "k"]
    peered = (
        with_peer.filter(pl.col("op") == "recv")
        .select("row", *keys)
        .join(with_peer.filter(pl.col("op") == "send").select(*keys, partner_row=pl.col("row")), on=keys, how="inner")
        .select("row", "partner_row")
    )
    no_peer = p2p.filter(pl.col("peer").is_null())
    recvs = no_peer.filter(pl.col("op") == "recv").select("row", "rank", "comm_id", "end_ns").sort("end_ns")
    sends = (
        no_peer.filter(pl.col("op") == "send")
        .select(
            partner_row=pl.col("row"), send_rank=pl.col("rank"), comm_id=pl.col("comm_id"), send_end=pl.col("end_ns")
        )
        .sort("send_end")
    )
    if recvs.height and sends.height:
        # Candidates: sends on other ranks of the communicator ending within the window (found
        # through window-sized time buckets), nearest first; each send pairs with one receive.
        recvs = recvs.with_columns(bucket=pl.col("end_ns") // P2P_WINDOW_NS)
        sends = sends.with_columns(bucket=(pl.col("send_end") // P2P_WINDOW_NS) + pl.lit([-1, 0, 1])).explode("bucket")
        guessed = (
            recvs.join(sends, on=["comm_id", "bucket"], how="inner")
            .filter(
                (pl.col("send_rank") != pl.col("rank"))
                & ((pl.col("send_end") - pl.col("end_ns")).abs() <= P2P_WINDOW_NS)
            )
            .with_columns(d=(pl.col("send_end") - pl.col("end_ns")).abs())
            .sort("d", "row", "partner_row")
            .unique("partner_row", keep="first", maintain_order=True)
            .unique("row", keep="first", maintain_order=True)
            .select("row", "partner_row")
        )
    else:
        guessed = pl.DataFrame(schema={"row": pl.Int64, "partner_row": pl.Int64})
    return pl.concat([peered, guessed], how="vertical_relaxed")


def _events(df: pl.DataFrame) -> pl.DataFrame:
    """The columns matching reads, with arrival (start, else enqueue) and an end that is never null."""
    arrival = pl.coalesce(pl.col("start_ns"), pl.col("enqueue_ns"))
    base = df.select(
        "row", "rank", "comm_id", "op", "is_p2p", "seq", "peer", "comm_size", "start_ns", "end_ns", "enqueue_ns"
    )
    return base.with_columns(arrival_ns=arrival, end_ns=pl.coalesce(pl.col("end_ns"), arrival))


def _collectives(events: pl.DataFrame) -> pl.DataFrame:
    """Collective events with their instance ``key`` (communicator, op, seq; null when any is unknown)."""
    coll = events.filter(~pl.col("is_p2p") & (pl.col("op") != "compute") & (pl.col("comm_size").fill_null(2) > 1))
    return coll.with_columns(
        key=pl.concat_str([pl.lit("c"), pl.col("comm_id"), pl.col("op"), pl.col("seq").cast(pl.String)], separator="|")
    )


def _member_wait(last: pl.Expr) -> pl.Expr:
    """Time a member spent inside the operation before its last member arrived."""
    return (pl.min_horizontal(last, pl.col("end_ns")) - pl.col("arrival_ns")).clip(lower_bound=0)


def collective_instances(df: pl.DataFrame) -> pl.DataFrame:
    """Per collective instance among ``df``'s rows: ``key``, communicator, last arrival, ranks seen (``n_members``).

    Instances seen by disjoint sets of ranks merge by max and sum (a partitioned run's first stage).
    """
    coll = _collectives(_events(df.with_row_index("row")))
    return (
        coll.filter(pl.col("key").is_not_null())
        .group_by("key")
        .agg(
            comm_id=pl.col("comm_id").first(),
            last=pl.col("arrival_ns").max(),
            n_members=pl.col("rank").n_unique(),
        )
    )


def collective_waits(df: pl.DataFrame, instances: pl.DataFrame) -> pl.DataFrame:
    """(``row``, ``wait_ns``) of ``df``'s collective events (``df`` carries ``row``) given the job's instances
    (``key``, ``last``) of two or more members: what ``match_operations`` says of them over the whole job."""
    coll = _collectives(_events(df))
    return coll.join(instances.select("key", "last"), on="key", how="inner").select(
        "row", wait_ns=_member_wait(pl.col("last"))
    )


def p2p_pairs(df: pl.DataFrame) -> pl.DataFrame:
    """(``row``, ``partner_row``): each receive among ``df``'s rows (which carry ``row``) with its send."""
    return _pair_p2p(_events(df.filter(pl.col("is_p2p"))))


def match_operations(df: pl.DataFrame, pairs: pl.DataFrame | None = None) -> pl.DataFrame:
    """Per event: matched ``group`` (-1 local), ``partner_row`` (a receive's send), arrival, lateness, waiting.

    ``df`` must carry a ``row`` column (row index); the result is in ``row`` order. ``pairs`` (``p2p_pairs`` of a
    larger table holding ``df``, e.g. the whole job when ``df`` is a window of its steps): the send/receive pairs
    to use instead of pairing ``df``'s own point-to-point rows; those of other rows are left out.
    """
    base = _events(df)
    coll = _collectives(base)
    if pairs is None:
        pairs = _pair_p2p(base.filter(pl.col("is_p2p")))
    else:
        pairs = pairs.join(base.select("row"), on="row", how="semi")
    # A transfer is a two-member group (receive and its send) for lateness and waiting.
    p2p_members = pl.concat(
        [
            pairs.select("row", key=pl.lit("p|") + pl.col("row").cast(pl.String)),
            pairs.select(row=pl.col("partner_row"), key=pl.lit("p|") + pl.col("row").cast(pl.String)),
        ]
    ).unique("row", keep="first")
    p2p = base.join(p2p_members, on="row", how="inner")
    matched = pl.concat([coll, p2p], how="vertical_relaxed")
    stats = (
        matched.group_by("key")
        .agg(first=pl.col("arrival_ns").min(), last=pl.col("arrival_ns").max(), n_members=pl.col("rank").n_unique())
        .filter(pl.col("n_members") > 1)
        .with_columns(group=pl.int_range(pl.len(), dtype=pl.Int64))
    )
    matched = matched.join(stats, on="key", how="inner").select(
        "row",
        "group",
        "n_members",
        "is_p2p",
        lateness_ns=pl.col("arrival_ns") - pl.col("first"),
        wait_ns=_member_wait(pl.col("last")),
        last_arrival_ns=pl.col("last"),
    )
    out = base.select("row", "rank", "arrival_ns").join(matched, on="row", how="left").join(pairs, on="row", how="left")
    return out.sort("row").with_columns(
        pl.col("group").fill_null(-1),
        pl.col("n_members").fill_null(1),
        pl.col("lateness_ns").fill_null(0),
        pl.col("wait_ns").fill_null(0),
        pl.col("is_p2p").fill_null(False),
    )
