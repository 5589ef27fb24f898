"""The one order every analysis reads operations in: operations a rank starts at the same instant keep their place
in the program from step to step, whatever order they happen to end in."""

from __future__ import annotations

import polars as pl

from comminsight.semantic.order import canonical_order


def _grouped_pairs(steps: int) -> pl.DataFrame:
    """One rank posting a grouped send and receive (same start, same issue time) every step; which of the two
    ends first changes from step to step, as it does on a real pipeline stage."""
    rows = []
    for step in range(steps):
        start = 1_000_000 * (step + 1)
        send_end, recv_end = (start + 500, start + 700) if step % 2 else (start + 700, start + 500)
        rows.append(
            {
                "rank": 0,
                "start_ns": start,
                "end_ns": recv_end,
                "enqueue_ns": start - 10,
                "comm_id": 7,
                "op": "recv",
                "is_p2p": True,
                "seq": 2 * step,
                "peer": 1,
                "bytes": 4096,
            }
        )
        rows.append(
            {
                "rank": 0,
                "start_ns": start,
                "end_ns": send_end,
                "enqueue_ns": start - 10,
                "comm_id": 7,
                "op": "send",
                "is_p2p": True,
                "seq": 2 * step + 1,
                "peer": 1,
                "bytes": 4096,
            }
        )
    return pl.DataFrame(rows)


def test_a_grouped_send_and_receive_keep_one_place_in_the_program_whichever_ends_first() -> None:
    table = _grouped_pairs(6)
    for shuffled in (table, table.reverse(), table.sample(fraction=1.0, shuffle=True, seed=3)):
        ops = canonical_order(shuffled).get_column("op").to_list()
        assert ops == ["recv", "send"] * 6


def test_operations_started_together_are_put_in_the_order_they_were_issued() -> None:
    table = _grouped_pairs(2).with_columns(
        pl.when(pl.col("op") == "send").then(pl.col("enqueue_ns") - 5).otherwise(pl.col("enqueue_ns"))
    )
    assert canonical_order(table.reverse()).get_column("op").to_list() == ["send", "recv"] * 2
