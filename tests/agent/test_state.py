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


# --- Hang detection on a simulated clock: every time below is given, none is read from the machine ----------

T0 = 1_800_000_000_000_000_000  # the simulated clock's origin (ns)
S = 1_000_000_000


def history(state: LiveState, ranks: int, n: int, latency_s: float, func: str = "AllReduce") -> int:
    """Each rank completed ``n`` ops of ``func``, each ``latency_s`` from enqueue to completion, one per second
    from T0; returns the simulated time the last one completed."""
    from pywriter import header

    for rank in range(ranks):
        ops = make_records(n, comm_hash=COMM, rank=rank, nranks=ranks, pid=100 + rank, func=func, start_ns=T0)
        ops["enqueue_end_ns"] = T0 + ops["seq"].astype("int64") * S
        ops["complete_ns"] = ops["enqueue_end_ns"] + int(latency_s * S)
        header.seal_records(ops)
        state.apply(f"w{rank}", ops)
    return T0 + (n - 1) * S + int(latency_s * S)


def stuck(
    state: LiveState, ranks: list[int], nranks: int, seq: int, at_ns: int, func: str = "AllReduce", record_seq: int = 30
) -> None:
    """``ranks`` entered op ``seq`` at ``at_ns`` and are still inside (the profiler's in-flight report, each
    writer's record ``record_seq``: the next after ``history``'s)."""
    from pywriter import header

    for rank in ranks:
        snap = make_records(
            1, comm_hash=COMM, rank=rank, nranks=nranks, pid=100 + rank, first_seq=seq, first_record_seq=record_seq,
            func=func, state=C["CI_STATE_INFLIGHT"], start_ns=at_ns,
        )  # fmt: skip
        snap["enqueue_end_ns"] = at_ns
        snap["complete_ns"] = 0
        header.seal_records(snap)
        state.apply(f"w{rank}", snap)


def test_a_stall_inside_a_collective_is_reported_when_its_age_passes_the_floor_threshold() -> None:
    state = LiveState(hang_floor_s=10.0, hang_factor=20.0)
    done = history(state, 4, 30, latency_s=0.2)  # normal: 0.2 s, x20 = 4 s, under the 10 s floor
    assert state.threshold_s(COMM, "AllReduce") == 10.0
    stuck(state, [0, 1, 3], 4, seq=30, at_ns=done + S)  # rank 2 never arrives
    assert state.detect_hangs(now_ns=done + S + int(9.9 * S))[0] == []
    suspicions, new = state.detect_hangs(now_ns=done + S + int(10.1 * S))
    assert [s["never_entered"] for s in suspicions] == [[2]]
    assert new == suspicions


def test_an_op_that_is_normally_slow_gets_a_threshold_from_its_own_history() -> None:
    state = LiveState(hang_floor_s=10.0, hang_factor=20.0)
    done = history(state, 2, 30, latency_s=1.0)  # normal: 1 s, so 20 s before a stall is believed
    assert abs(state.threshold_s(COMM, "AllReduce") - 20.0) < 0.5
    stuck(state, [0], 2, seq=30, at_ns=done)
    assert state.detect_hangs(now_ns=done + 15 * S)[0] == []
    assert state.detect_hangs(now_ns=done + 21 * S)[0][0]["never_entered"] == [1]


def test_an_op_never_completed_on_its_communicator_waits_for_the_cold_threshold() -> None:
    state = LiveState(hang_floor_s=10.0, hang_factor=20.0, hang_cold_s=60.0)
    history(state, 2, 30, latency_s=0.2)
    stuck(state, [0], 2, seq=0, at_ns=T0 + 100 * S, func="AllGather")  # first all-gather ever (warm-up)
    assert state.threshold_s(COMM, "AllGather") == 60.0
    assert state.detect_hangs(now_ns=T0 + 150 * S)[0] == []
    assert state.detect_hangs(now_ns=T0 + 161 * S)[0][0]["op"] == "AllGather"


def test_a_long_pause_outside_communication_is_never_a_hang() -> None:
    state = LiveState(hang_floor_s=10.0, hang_factor=20.0)
    done = history(state, 4, 30, latency_s=0.2)
    # Checkpointing, evaluation or data loading on every rank: nothing is in flight, for any length of time.
    for pause_s in (15, 90, 3600):
        assert state.detect_hangs(now_ns=done + pause_s * S) == ([], [])
    # The job comes back: the next all-reduce is entered and completed by everyone; still nothing.
    for rank in range(4):
        state.apply(
            f"w{rank}",
            make_records(1, comm_hash=COMM, rank=rank, nranks=4, pid=100 + rank, first_seq=30, first_record_seq=30),
        )
    assert state.detect_hangs(now_ns=done + 3700 * S) == ([], [])
