"""The one order of operations every analysis reads a table in, whatever order the input stored it in.

Step recovery and the straggler analysis read a set of operations, but row numbers break their ties
(operations a rank posted at the same instant, the first row of a communicator): the rows of one job read
as one table, as one file per archive and rank (the partitioned runs), or shuffled, must give the same
report to the bit. Both put the rows in this order first (``canonical_order``).
"""

from __future__ import annotations

import polars as pl

# Every column an analysis reads of an operation (per-communicator facts such as its members are the same on
# all its rows). Rank first: a partition of whole ranks in this order is a slice of the whole table's. Operations
# a rank starts at the same instant (a grouped send and receive) are put in program order, by issue time and
# then by what they are, never by when they end: ends vary from step to step, and an order that follows them
# gives the same operation a different place in the program in different steps (and no typical duration).
ORDER_COLUMNS = ("rank", "start_ns", "enqueue_ns", "comm_id", "is_p2p", "op", "peer", "seq", "end_ns", "bytes")
ORDER_COLUMNS += ("comm_name", "step", "comm_desc", "comm_size", "dp_rank", "pp_rank", "tp_rank", "cp_rank")


def canonical_permutation(df: pl.DataFrame) -> pl.Series | None:
    """The row positions of ``df`` in ``ORDER_COLUMNS`` order (ties kept in input order: rows equal in every
    ordered column are the same operation to the analyses); None when ``df`` is already in that order."""
    keys = [c for c in ORDER_COLUMNS if c in df.columns]
    if not keys or df.height < 2:
        return None
    order = df.select(pl.arg_sort_by(keys, nulls_last=True, maintain_order=True)).to_series()
    return None if order.is_sorted() else order


def canonical_order(df: pl.DataFrame) -> pl.DataFrame:
    """``df`` in ``ORDER_COLUMNS`` order; no copy when already in that order (importers write ranks in time order)."""
    order = canonical_permutation(df)
    return df if order is None else df[order]
