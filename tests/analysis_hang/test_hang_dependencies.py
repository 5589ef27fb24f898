"""Who waits on whom across operations: P2P partners whose stream is busy elsewhere, ranks missing
from a collective because they are blocked in an earlier one, and records a source lost or doubled.

Tables are written out by hand (a few rows each) so every case says exactly what the evidence holds.
"""

from __future__ import annotations

import pyarrow as pa

from comminsight.analysis import analyze_hang
from comminsight.evidence import conform

T0 = 1_700_000_000_000_000_000
MS = 1_000_000


def coll(rank: int, comm: str, members: list[int], seq: int, state: str, t_ms: int, op: str = "all_reduce") -> dict:
    return {
        "rank": rank,
        "comm_id": comm,
        "comm_ranks": members,
        "comm_size": len(members),
        "op": op,
        "is_p2p": False,
        "seq": seq,
        "seq_kind": "func",
        "state": state,
        "enqueue_ns": T0 + t_ms * MS,
        "end_ns": T0 + t_ms * MS + 100 if state == "completed" else None,
    }


def p2p(rank: int, comm: str, members: list[int], op: str, peer: int, seq: int, state: str, t_ms: int) -> dict:
    return {
        "rank": rank,
        "comm_id": comm,
        "comm_ranks": members,
        "comm_size": len(members),
        "op": op,
        "is_p2p": True,
        "seq": seq,
        "seq_kind": "p2p",
        "peer": peer,
        "state": state,
        "enqueue_ns": T0 + t_ms * MS,
    }


def table(rows: list[dict]) -> pa.Table:
    # from_pylist takes its columns from the first row: give every row every key.
    keys = {key for row in rows for key in row}
    return conform(pa.Table.from_pylist([{"source": "table", **dict.fromkeys(keys), **row} for row in rows]))


def readme_like() -> list[dict]:
    """Rank 0 hangs before a dp all_gather; rank 1 waits in it, then posts a recv from rank 2; rank 2
    is inside its send to rank 1 and so never enters a tp all_reduce that rank 3 waits in."""
    dp, pp, tp = [0, 1], [1, 2], [2, 3]
    return [
        coll(0, "dp", dp, 0, "completed", 1),
        coll(1, "dp", dp, 0, "completed", 1),
        coll(1, "dp", dp, 0, "enqueued", 5, op="all_gather"),
        p2p(1, "pp", pp, "recv", 2, 0, "enqueued", 6),
        p2p(2, "pp", pp, "send", 1, 0, "enqueued", 7),
        coll(2, "tp", tp, 0, "completed", 2),
        coll(3, "tp", tp, 0, "completed", 2),
        coll(3, "tp", tp, 1, "enqueued", 8),
    ]


def test_a_rank_inside_a_send_to_a_peer_blocked_earlier_waits_on_that_peer():
    report = analyze_hang(table(readme_like()))
    assert report["root_cause_ranks"] == [0]
    assert report["wait_paths"][0] == [2, 1, 0]
    pair = next(g for g in report["stuck_groups"] if g["seq_kind"] == "p2p")
    assert pair["kind"] == "p2p_inside"
    assert pair["blocked_earlier_ranks"] == [1]
    assert pair["waiting_ranks"] == [2]
    assert report["evidence"]["2"]["waits_on"] == [1]
    assert report["evidence"]["2"]["status"] == "missing"


def test_a_rank_missing_because_blocked_earlier_is_not_a_root_cause_without_times():
    # Without times, the source's record ids give each rank's own order (Flight Recorder style).
    rows = readme_like()
    for i, row in enumerate(rows):
        row["record_id"], row["enqueue_ns"], row["end_ns"] = i, None, None
    report = analyze_hang(table(rows))
    assert report["root_cause_ranks"] == [0]


def test_both_sides_inside_a_send_recv_with_nothing_earlier_blame_no_one_by_themselves():
    pp = [0, 1]
    rows = [p2p(0, "pp", pp, "send", 1, 0, "enqueued", 1), p2p(1, "pp", pp, "recv", 0, 0, "enqueued", 1)]
    report = analyze_hang(table(rows))
    (pair,) = report["stuck_groups"]
    assert pair["kind"] == "p2p_inside"
    assert "blocked_earlier_ranks" not in pair
    assert report["chain"] == [] or all(not link["blocks"] for link in report["chain"])


def test_a_pending_send_recorded_twice_is_one_operation_not_an_unmatched_send():
    # Raw logs record an in-flight operation when enqueued and again when finalize abandons it.
    pp = [0, 1]
    rows = [
        p2p(0, "pp", pp, "send", 1, 3, "enqueued", 1),
        p2p(0, "pp", pp, "send", 1, 3, "abandoned", 1),
        p2p(1, "pp", pp, "recv", 0, 3, "enqueued", 1),
    ]
    (pair,) = analyze_hang(table(rows))["stuck_groups"]
    assert pair["kind"] == "p2p_inside"
    assert (pair["pending_sends"], pair["pending_recvs"]) == (1, 1)


def test_a_collective_peers_completed_counts_as_entered_by_a_rank_whose_records_were_lost():
    # Rank 2 crashed before its last records were flushed: its log stops at seq 1, yet seq 2
    # completed on its peers, so it took part. They now wait in seq 3, which it never entered.
    world = [0, 1, 2]
    rows = [coll(r, "w", world, s, "completed", s) for r in world for s in (0, 1)]
    rows += [coll(r, "w", world, 2, "completed", 2) for r in (0, 1)]
    rows += [coll(r, "w", world, 3, "enqueued", 3) for r in (0, 1)]
    report = analyze_hang(table(rows))
    first = report["stuck_groups"][0]
    assert (first["seq"], first["missing_ranks"], first["entered_ranks"]) == (3, [2], [0, 1])
    assert report["root_cause_ranks"] == [2]
