"""Live state and hang detection over record batches (no processes)."""

from __future__ import annotations

import time

from pywriter import C, make_records

from comminsight.agent.cluster import ClusterView
from comminsight.agent.state import LiveState

COMM = 0x1111222233334444


def completed(state: LiveState, rank: int, n: int, nranks: int = 4, first_record_seq: int = 0) -> None:
    state.apply(
        f"w{rank}",
        make_records(n, comm_hash=COMM, rank=rank, nranks=nranks, pid=100 + rank, first_record_seq=first_record_seq),
    )


def test_progress_counts_each_record_once_even_if_seen_twice() -> None:
    state = LiveState()
    completed(state, 0, 10)
    completed(state, 0, 10)  # the same records again (ring then log): ignored by record_seq
    view = state.communicators_view()[0]
    assert view["ops"]["AllReduce"]["count"] == 10
    assert view["ranks"]["0"]["last_completed"]["seq"] == 9


def test_lagging_ranks_are_those_behind_the_most_advanced() -> None:
    state = LiveState()
    for rank, n in ((0, 10), (1, 10), (2, 7), (3, 10)):
        completed(state, rank, n)
    assert state.communicators_view()[0]["lagging_ranks"] == [2]


def test_hang_names_communicator_op_and_the_ranks_that_never_entered() -> None:
    state = LiveState(hang_threshold_s=0.0, hang_floor_s=1.0, hang_factor=20.0)
    for rank in range(4):
        completed(state, rank, 5)
    enqueued = time.time_ns() - 3_000_000_000  # in flight for 3 s
    for rank in (0, 1, 3):
        state.apply(
            f"w{rank}",
            make_records(
                1,
                comm_hash=COMM,
                rank=rank,
                nranks=4,
                pid=100 + rank,
                first_seq=5,
                first_record_seq=5,
                state=C["CI_STATE_TIMEOUT"],
                start_ns=enqueued,
            ),
        )
    suspicions, new = state.detect_hangs()
    assert len(suspicions) == 1
    assert new == suspicions
    hang = suspicions[0]
    assert hang["comm_hash"] == f"0x{COMM:016x}"
    assert hang["op"] == "AllReduce"
    assert hang["seq"] == 5
    assert hang["never_entered"] == [2]
    assert [e["rank"] for e in hang["entered"]] == [0, 1, 3]
    assert hang["oldest_age_s"] >= 3.0
    assert state.detect_hangs()[1] == []  # raised once, not again


def test_adaptive_threshold_follows_the_op_normal_duration_with_a_floor() -> None:
    state = LiveState(hang_threshold_s=0.0, hang_floor_s=2.0, hang_factor=10.0)
    completed(state, 0, 50)  # 500 ns GPU duration each
    assert state.threshold_s(COMM, "AllReduce") == 2.0  # the floor wins for fast ops
    fixed = LiveState(hang_threshold_s=7.5)
    assert fixed.threshold_s(COMM, "AllReduce") == 7.5


def test_an_in_flight_op_below_threshold_is_not_a_hang_and_completion_clears_it() -> None:
    state = LiveState(hang_floor_s=60.0)
    completed(state, 0, 3)
    state.apply(
        "w0",
        make_records(
            1, comm_hash=COMM, rank=0, nranks=4, pid=100, first_seq=3, first_record_seq=3, state=C["CI_STATE_TIMEOUT"]
        ),
    )
    assert len(state.inflight_view()) == 1
    assert state.detect_hangs()[0] == []
    state.apply("w0", make_records(1, comm_hash=COMM, rank=0, nranks=4, pid=100, first_seq=3, first_record_seq=4))
    assert state.inflight_view() == []


def test_checkpointed_state_restores_exactly() -> None:
    state = LiveState()
    completed(state, 0, 10)
    completed(state, 1, 8)
    again = LiveState()
    again.restore(state.to_json())
    assert again.communicators_view()[0]["ops"] == state.communicators_view()[0]["ops"]
    completed(again, 0, 10)  # already applied before the checkpoint
    assert again.communicators_view()[0]["ops"]["AllReduce"]["count"] == 18


def test_master_merges_nodes_and_names_never_entered_ranks_across_nodes() -> None:
    node_a, node_b = LiveState(hang_floor_s=1.0), LiveState(hang_floor_s=1.0)
    for rank in (0, 1):
        completed(node_a, rank, 5)
    for rank in (2, 3):
        completed(node_b, rank, 5)
    old = time.time_ns() - 5_000_000_000
    for state, rank in ((node_a, 0), (node_a, 1), (node_b, 3)):
        state.apply(
            f"w{rank}",
            make_records(
                1,
                comm_hash=COMM,
                rank=rank,
                nranks=4,
                pid=100 + rank,
                first_seq=5,
                first_record_seq=5,
                state=C["CI_STATE_TIMEOUT"],
                start_ns=old,
            ),
        )
    cluster = ClusterView()
    cluster.accept({"node": "b", "communicators": node_b.communicators_view(), "hang": node_b.detect_hangs()[0]})
    comms, hangs = cluster.merge("a", node_a.communicators_view(), node_a.detect_hangs()[0])
    assert len(comms) == 1
    assert sorted(comms[0]["ranks"]) == ["0", "1", "2", "3"]
    assert hangs[0]["never_entered"] == [2]
    assert hangs[0]["never_entered_nodes"] == {"2": "b"}
