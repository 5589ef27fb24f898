"""Communication performance: algorithm and bus bandwidth against the best observed.

For every matched collective the transfer time is measured from the last member's arrival to
the operation's end (time spent waiting for late members is not the network's fault); for an
unmatched operation it is its own duration. algbw = bytes / time; busbw = algbw x bus factor,
with the bus factor 2(n-1)/n for all-reduce, (n-1)/n for all-gather and reduce-scatter and 1
otherwise (n = communicator size). Rows are grouped per (communicator, op, size bucket), where
the size bucket is the power of two at or above the payload. The reference is the best median
bus bandwidth observed for that (op, size bucket, n) anywhere in the job; a communicator, a rank
or a P2P link whose median falls below ``slow_fraction`` of the reference is flagged, with the
numbers that put it there.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import polars as pl
import pyarrow as pa

from comminsight.semantic.matching import match_operations


def bus_factor(op: str, n: int) -> float:
    """NCCL's bus-bandwidth factor for ``op`` on ``n`` ranks."""
    if n <= 1:
        return 1.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    return 1.0


def transfers(table: pa.Table | pl.DataFrame) -> pl.DataFrame | None:
    """Per matched operation with a payload: transfer time, size bucket, bus factor, algbw and busbw.

    Matching is per communicator, so rows of whole communicators (every member) give the same
    transfers alone as inside the job (``comminsight.analysis.partitioned`` relies on it).
    """
    df = table if isinstance(table, pl.DataFrame) else pl.from_arrow(table)
    assert isinstance(df, pl.DataFrame)
    df = df.with_row_index("row").with_columns(pl.col("row").cast(pl.Int64))
    comm = df.filter((pl.col("op") != "compute") & pl.col("bytes").is_not_null() & (pl.col("bytes") > 0))
    if comm.height == 0:
        return None  # no operation with a payload size
    matches = match_operations(comm)
    ev = comm.join(matches.select("row", "last_arrival_ns", "group"), on="row", how="left")
    ev = ev.with_columns(
        transfer_ns=(
            pl.col("end_ns")
            - pl.max_horizontal(pl.col("start_ns"), pl.col("last_arrival_ns").fill_null(pl.col("start_ns")))
        ),
        n=pl.col("comm_size").fill_null(2).clip(lower_bound=1),
        bucket=(pl.col("bytes").cast(pl.Float64).log(2).ceil()).cast(pl.Int64),
    ).filter(pl.col("transfer_ns") > 0)
    n = pl.col("n").cast(pl.Float64)
    ev = ev.with_columns(  # bus_factor, vectorised
        factor=pl.when(pl.col("n") <= 1)
        .then(1.0)
        .when(pl.col("op") == "all_reduce")
        .then(2.0 * (n - 1) / n)
        .when(pl.col("op").is_in(["all_gather", "reduce_scatter"]))
        .then((n - 1) / n)
        .otherwise(1.0)
    )
    ev = ev.with_columns(algbw=pl.col("bytes") / pl.col("transfer_ns"))  # bytes/ns == GB/s
    return ev.with_columns(busbw=pl.col("algbw") * pl.col("factor"))


GROUP_KEYS = ["comm_id", "op", "bucket", "n"]
GROUP_MEDIANS = {"bytes": "bytes", "algbw_gbs": "algbw", "busbw_gbs": "busbw", "transfer_us": "transfer_ns"}
P10 = 0.1  # busbw_p10_gbs: polars' "nearest" quantile, one of the group's own values


def group_medians() -> dict[str, pl.Expr]:
    """The group figures that are medians (output column: expression over the transfers' column)."""
    return {
        "bytes": pl.col("bytes").median(),
        "algbw_gbs": pl.col("algbw").median(),
        "busbw_gbs": pl.col("busbw").median(),
        "transfer_us": pl.col("transfer_ns").median() / 1e3,
    }


def group_p10() -> pl.Expr:
    return pl.col("busbw").quantile(P10)


def bandwidth_groups(ev: pl.DataFrame) -> pl.DataFrame:
    """Per (communicator, op, size bucket, n): samples and medians (exact for whole communicators)."""
    medians = group_medians()
    return ev.group_by(*GROUP_KEYS).agg(
        samples=pl.len(),
        bytes=medians["bytes"],
        algbw_gbs=medians["algbw_gbs"],
        busbw_gbs=medians["busbw_gbs"],
        busbw_p10_gbs=group_p10(),
        transfer_us=medians["transfer_us"],
    )


def rank_samples(ev: pl.DataFrame) -> pl.DataFrame:
    """What the per-rank and per-link figures need of each transfer (rank, op, bucket, n, busbw, peer)."""
    return ev.select("rank", "op", "bucket", "n", "busbw", "peer")


def perf_report(
    groups: pl.DataFrame,
    samples: pl.DataFrame | Iterable[pl.DataFrame],
    slow_fraction: float = 0.5,
    min_samples: int = 3,
) -> dict:
    """The report from per-communicator groups (``bandwidth_groups``) and per-transfer samples (``rank_samples``).

    ``samples`` is one frame, or frames that each hold every sample of their ranks (disjoint sets of ranks):
    per-rank and per-link figures are then computed one frame at a time, with the same result.
    """
    table_rows = (
        groups.with_columns(
            reference_busbw_gbs=pl.col("busbw_gbs")
            .filter(pl.col("samples") >= min_samples)
            .max()
            .over("op", "bucket", "n")
        )
        .with_columns(efficiency=pl.col("busbw_gbs") / pl.col("reference_busbw_gbs"))
        .sort("op", "bucket", "comm_id")
    )
    slow_comms = table_rows.filter((pl.col("samples") >= min_samples) & (pl.col("efficiency") < slow_fraction))
    ref = table_rows.select("op", "bucket", "n", "reference_busbw_gbs").unique(["op", "bucket", "n"])
    rank_parts, link_parts = [], []
    for chunk in [samples] if isinstance(samples, pl.DataFrame) else samples:
        # Ranks: a rank's transfers against the same reference, over all its collectives.
        rank_parts.append(
            chunk.join(ref, on=["op", "bucket", "n"], how="left")
            .with_columns(eff=pl.col("busbw") / pl.col("reference_busbw_gbs"))
            .group_by("rank")
            .agg(samples=pl.len(), median_efficiency=pl.col("eff").median())
        )
        # Links: P2P transfers with a known peer, per (rank, peer); a link's samples are its receiver's.
        # The receiving side measures a transfer (a send may return once its data is handed off).
        p2p = chunk.filter((pl.col("op") == "recv") & pl.col("peer").is_not_null())
        if p2p.height:
            link_parts.append(
                p2p.with_columns(src=pl.col("peer"), dst=pl.col("rank"))
                .group_by("src", "dst", "bucket")
                .agg(samples=pl.len(), busbw_gbs=pl.col("busbw").median())
            )
    per_rank = (
        pl.concat(rank_parts, how="vertical_relaxed").filter(pl.col("samples") >= min_samples).sort("median_efficiency")
        if rank_parts
        else pl.DataFrame()
    )
    slow_ranks = per_rank.filter(pl.col("median_efficiency") < slow_fraction) if rank_parts else per_rank
    links = pl.DataFrame()
    slow_links = pl.DataFrame()
    if link_parts:
        links = (
            pl.concat(link_parts, how="vertical_relaxed")
            .with_columns(reference_busbw_gbs=pl.col("busbw_gbs").max().over("bucket"))
            .with_columns(efficiency=pl.col("busbw_gbs") / pl.col("reference_busbw_gbs"))
            .sort("efficiency")
        )
        slow_links = links.filter((pl.col("samples") >= min_samples) & (pl.col("efficiency") < slow_fraction))
    return {
        "bandwidth": _records(table_rows),
        "slow_communicators": _records(slow_comms),
        "slow_ranks": _records(slow_ranks),
        "slow_links": _records(slow_links) if slow_links.height else [],
        "links": _records(links) if links.height else [],
        "slow_fraction": slow_fraction,
    }


NO_PAYLOAD = {
    "bandwidth": [],
    "slow_communicators": [],
    "slow_ranks": [],
    "slow_links": [],
    "note": "no operations with payload sizes",
}


def analyse_perf(table: pa.Table | pl.DataFrame, slow_fraction: float = 0.5, min_samples: int = 3) -> dict:
    """Bandwidth table and flagged slow communicators, ranks and links (see module doc)."""
    ev = transfers(table)
    if ev is None:
        return dict(NO_PAYLOAD)
    return perf_report(bandwidth_groups(ev), rank_samples(ev), slow_fraction, min_samples)


def _records(frame: pl.DataFrame) -> list[dict]:
    out = []
    for row in frame.iter_rows(named=True):
        out.append({k: (float(v) if isinstance(v, float | np.floating) else v) for k, v in row.items()})
    return out
