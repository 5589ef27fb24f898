"""End to end: rank processes drive the real plugin .so; the raw logs it wrote are checked against the ground truth.

Multi-process: every test here starts one OS process per simulated rank (marked ``slow``).
"""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import polars as pl
import pytest

from comminsight.formats import header
from comminsight.simulator.plan import Crash, Hang, SlowLink, Straggler, config_from_dict
from simulator.rawlogs import read_home, text

pytestmark = pytest.mark.slow

COMPLETED = header.constants()["CI_STATE_COMPLETED"]
CLOCK_SLACK_NS = 10_000_000


def expected_ops(truth: dict) -> dict[int, list[dict]]:
    """Per global rank, the ground truth's operations that the plugin must record."""
    ops = truth["operations"]
    out: dict[int, list[dict]] = defaultdict(list)
    for i in range(len(ops["rank"])):
        row = {k: v[i] for k, v in ops.items()}
        if row["recorded"]:
            out[row["rank"]].append(row)
    return out


def key(comm_hash: str, func: str, seq: int, comm_rank: int) -> tuple:
    return (comm_hash, func, seq, comm_rank)


def recorded(records: np.ndarray) -> dict[tuple, np.void]:
    return {key(f"{int(r['comm_hash']):#018x}", text(r["func"]), int(r["seq"]), int(r["rank"])): r for r in records}


def assert_every_operation_recorded(truth: dict, logs: dict[int, dict]) -> None:
    """Every emitted operation of every rank has one completed record with the right comm/func/seq/peer/times."""
    comms = {c["comm_hash"]: c for c in truth["communicators"]}
    for rank, ops in expected_ops(truth).items():
        records = recorded(logs[rank]["records"])
        assert len(records) == len(logs[rank]["records"]), f"rank {rank}: duplicate records"
        want = {key(o["comm_hash"], o["func"], o["seq"], o["comm_rank"]): o for o in ops}
        assert set(records) == set(want), f"rank {rank}: records differ from the ground truth"
        for k, op in want.items():
            record = records[k]
            assert record["state"] == COMPLETED
            assert int(record["nranks"]) == comms[op["comm_hash"]]["nranks"]
            if op["func"] in ("Send", "Recv", "Broadcast"):
                assert int(record["peer"]) == op["peer"]
            assert text(record["dtype"]) == op["coll_dtype"]
            assert int(record["gpu_end_ns"]) == op["gpu_end_ns"]
            assert int(record["gpu_start_ns"]) == op["gpu_start_ns"]
            # The plugin stamps CPU times with its own clock (TSC or a coarse clock, converted to
            # CLOCK_REALTIME): they fall around the driver's call, within that clock's resolution.
            assert int(record["enqueue_start_ns"]) <= int(record["enqueue_end_ns"])
            assert op["enqueue_start_ns"] - CLOCK_SLACK_NS <= int(record["enqueue_start_ns"])
            assert int(record["enqueue_end_ns"]) <= op["enqueue_end_ns"] + CLOCK_SLACK_NS


def test_ddp_run_records_every_operation_of_every_rank(simulate) -> None:
    result = simulate(layout="ddp", ranks=4, steps=3)
    truth = result.ground_truth
    logs = read_home(result.home)

    assert sorted(logs) == [0, 1, 2, 3]
    assert_every_operation_recorded(truth, logs)
    assert all(r["outcome"] == "completed" and r["exit_code"] == 0 for r in truth["ranks"])
    steps = truth["steps"]
    assert len(steps["step"]) == 4 * 3
    assert all(end > start for start, end in zip(steps["start_ns"], steps["end_ns"], strict=True))
    assert {text(r["comm_name"]) for r in logs[0]["records"]} == {"world"}
    assert all(segment.endswith(".sealed") for entry in logs.values() for segment in entry["segments"])
    on_disk = json.loads(result.ground_truth_path.read_text())
    assert on_disk["communicators"][0]["ranks"] == [0, 1, 2, 3]
    assert pl.DataFrame(on_disk["operations"]).height == sum(r["launches_enqueued"] for r in on_disk["ranks"])


def test_fsdp_run_reports_allgather_in_bytes_of_int8(simulate) -> None:
    result = simulate(layout="fsdp", ranks=3, layers=2, steps=2)
    logs = read_home(result.home)

    assert_every_operation_recorded(result.ground_truth, logs)
    gathers = [r for r in logs[1]["records"] if text(r["func"]) == "AllGather"]
    assert gathers
    assert all(text(r["dtype"]) == "ncclInt8" for r in gathers)
    assert [int(r["seq"]) for r in gathers] == list(range(len(gathers)))


def test_megatron_run_over_two_nodes_records_pipeline_p2p_and_skips_one_rank_groups(simulate) -> None:
    result = simulate(layout="megatron", ranks=4, tp=2, pp=2, layers=1, micro_batches=2, nodes=2, steps=2)
    truth = result.ground_truth
    logs = read_home(result.home)

    assert_every_operation_recorded(truth, logs)
    assert [(logs[r]["node_ip"], logs[r]["local_rank"]) for r in range(4)] == [
        ("10.0.0.1", 0), ("10.0.0.1", 1), ("10.0.0.2", 0), ("10.0.0.2", 1),
    ]  # fmt: skip
    one_rank = {c["comm_hash"] for c in truth["communicators"] if c["nranks"] == 1}
    assert one_rank, "dp == 1 gives one-rank data-parallel groups"
    all_hashes = {f"{int(r['comm_hash']):#018x}" for entry in logs.values() for r in entry["records"]}
    assert not one_rank & all_hashes, "one-rank communicators emit no Coll events"
    sends = [r for r in logs[0]["records"] if text(r["func"]) == "Send"]
    assert sends
    assert {int(r["peer"]) for r in sends} == {1}
    # Every collective is joinable across its members by (commHash, func, seq).
    members = defaultdict(set)
    for rank, entry in logs.items():
        for r in entry["records"]:
            if text(r["func"]) not in ("Send", "Recv"):
                members[(int(r["comm_hash"]), text(r["func"]), int(r["seq"]))].add(rank)
    sizes = {c["comm_hash"]: c["nranks"] for c in truth["communicators"]}
    assert all(len(who) == sizes[f"{h:#018x}"] for (h, _, _), who in members.items())


def test_abi_v4_with_null_comm_names_records_every_operation(simulate) -> None:
    result = simulate(layout="ddp", ranks=2, steps=2, abi=4, comm_names=False)
    logs = read_home(result.home)

    assert_every_operation_recorded(result.ground_truth, logs)
    assert {text(r["comm_name"]) for entry in logs.values() for r in entry["records"]} == {""}


def test_a_straggler_enqueues_last_and_waits_least_from_its_step(simulate) -> None:
    result = simulate(layout="ddp", ranks=3, steps=4, step_ms=30.0, faults=(Straggler(1, 400.0, 2),))
    logs = read_home(result.home)
    truth = result.ground_truth
    assert truth["faults"] == [{"rank": 1, "slow_pct": 400.0, "from_step": 2, "phase": "", "type": "straggler"}]

    ops = truth["operations"]
    first_bucket = {(ops["step"][i], ops["seq"][i]) for i in range(len(ops["rank"])) if ops["role"][i] == "grad_bucket"}
    for step in (2, 3):
        seq = min(s for st, s in first_bucket if st == step)
        by_rank = {
            rank: recorded(logs[rank]["records"])[key(ops["comm_hash"][0], "AllReduce", seq, rank)] for rank in logs
        }
        enqueue = {rank: int(r["enqueue_start_ns"]) for rank, r in by_rank.items()}
        waited = {rank: int(r["gpu_end_ns"]) - int(r["gpu_start_ns"]) for rank, r in by_rank.items()}
        assert max(enqueue, key=enqueue.get) == 1, f"step {step}: the straggler arrives last"
        assert min(waited, key=waited.get) == 1, f"step {step}: the straggler waits least"


def test_a_hung_rank_never_enters_the_collective_its_peers_wait_in(simulate) -> None:
    result = simulate(layout="ddp", ranks=3, steps=3, faults=(Hang(2, 1, 1),), hang_timeout_s=2.0)
    truth = result.ground_truth
    logs = read_home(result.home)

    assert result.ended_by == "abort"
    assert truth["rank_env"]["COMMINSIGHT_HANG_TIMEOUT_S"] == "1"
    names = [p.name for p in (result.home / "hang_detection").iterdir()]
    evidence = {kind for name in names for kind in ("timeout", "finalize") if f"-{kind}-" in name}
    assert evidence == {"timeout", "finalize"}, "in-flight timeout evidence precedes the abort's finalize evidence"
    assert [r["outcome"] for r in truth["ranks"]] == ["aborted"] * 3
    (blocked,) = truth["faults"][0]["blocked_ops"]
    assert blocked["waiting_ranks"] == [0, 1]
    k = (blocked["comm_hash"], blocked["func"], blocked["seq"])
    hung = {key[:3] for key in recorded(logs[2]["records"])}
    assert k not in hung
    assert max(int(r["seq"]) for r in logs[2]["records"] if text(r["func"]) == "AllReduce") < blocked["seq"]
    for rank in (0, 1):
        record = recorded(logs[rank]["records"])[(*k, rank)]
        assert record["state"] != COMPLETED, "the peers' copy never completes"
        assert int(record["gpu_end_ns"]) == 0
    steps = truth["steps"]
    unfinished = [
        (s, r) for s, r, end in zip(steps["step"], steps["rank"], steps["end_ns"], strict=True) if end is None
    ]
    assert (1, 2) in unfinished


def test_a_crashed_rank_leaves_a_truncated_log_and_its_peers_stall(simulate) -> None:
    result = simulate(layout="ddp", ranks=3, steps=3, faults=(Crash(0, 1, 0, exit_code=7),), hang_timeout_s=1.0)
    truth = result.ground_truth
    logs = read_home(result.home)

    crashed = truth["ranks"][0]
    assert (crashed["outcome"], crashed["exit_code"]) == ("crashed", 7)
    assert [r["outcome"] for r in truth["ranks"][1:]] == ["aborted", "aborted"]
    assert not any(s.endswith(".sealed") for s in logs[0]["segments"]), "no finalize: the segment stays open"
    (blocked,) = truth["faults"][0]["blocked_ops"]
    crashed_seqs = {int(r["seq"]) for r in logs[0]["records"] if text(r["func"]) == blocked["func"]}
    assert all(seq < blocked["seq"] for seq in crashed_seqs), "nothing from the crash point on"
    assert len(logs[0]["records"]) < min(len(logs[r]["records"]) for r in (1, 2)), "the crashed log is truncated"
    for rank in (1, 2):
        record = recorded(logs[rank]["records"])[(blocked["comm_hash"], blocked["func"], blocked["seq"], rank)]
        assert record["state"] != COMPLETED


def test_a_slow_link_makes_only_that_pairs_transfers_slower(simulate) -> None:
    result = simulate(
        layout="megatron", ranks=4, tp=1, pp=2, layers=1, micro_batches=2, faults=(SlowLink((0, 2), 20.0),)
    )
    logs = read_home(result.home)

    def fastest_p2p(rank: int) -> int:
        records = [r for r in logs[rank]["records"] if text(r["func"]) in ("Send", "Recv")]
        return min(int(r["gpu_end_ns"]) - int(r["gpu_start_ns"]) for r in records)

    # The last of a pair to arrive waits for nothing: its GPU time is the transfer alone.
    slow = min(fastest_p2p(0), fastest_p2p(2))
    fast = min(fastest_p2p(1), fastest_p2p(3))
    assert slow > 5 * fast
    assert result.ground_truth["faults"][0]["ranks"] == [0, 2]


def test_a_slow_link_inside_a_tp_group_slows_that_groups_all_reduces_on_every_member(simulate) -> None:
    # TP2 x DP2: the TP groups are (0, 1) and (2, 3); the link 0-1 is on tp0's ring (and mp0's, the same ranks).
    result = simulate(layout="megatron", ranks=4, tp=2, pp=1, layers=1, faults=(SlowLink((0, 1), 20.0),))
    logs = read_home(result.home)
    comms = {c["name"]: c["comm_hash"] for c in result.ground_truth["communicators"]}

    def fastest(rank: int, comm: str, func: str) -> int:
        records = [
            r
            for r in logs[rank]["records"]
            if f"{int(r['comm_hash']):#018x}" == comms[comm] and text(r["func"]) == func
        ]
        assert records, f"rank {rank} has no {func} on {comm}"
        return min(int(r["gpu_end_ns"]) - int(r["gpu_start_ns"]) for r in records)

    # The last member to arrive waits for nothing: its GPU time is the transfer alone, on every member.
    slow = min(fastest(0, "tp0", "AllReduce"), fastest(1, "tp0", "AllReduce"))
    fast = min(fastest(2, "tp1", "AllReduce"), fastest(3, "tp1", "AllReduce"))
    assert slow > 5 * fast
    dp0 = min(fastest(0, "dp0", "ReduceScatter"), fastest(2, "dp0", "ReduceScatter"))
    dp1 = min(fastest(1, "dp1", "ReduceScatter"), fastest(3, "dp1", "ReduceScatter"))
    assert dp0 < 2 * dp1  # the DP rings (0, 2) and (1, 3) do not cross the link
    crossed = {c["comm_name"]: c["funcs"] for c in result.ground_truth["faults"][0]["crossed_by"]}
    assert crossed == {"tp0": ["AllReduce"], "mp0": ["AllReduce"]}
    assert config_from_dict(result.ground_truth["config"]).faults == (SlowLink((0, 1), 20.0),)  # reads back


def test_on_hang_kill_ends_the_run_with_sigkill(simulate) -> None:
    result = simulate(layout="ddp", ranks=2, steps=2, faults=(Hang(1, 1, 0),), hang_timeout_s=1.0, on_hang="kill")

    assert result.ended_by == "kill"
    assert [r["outcome"] for r in result.ground_truth["ranks"]] == ["killed", "killed"]
    assert all(code is not None and code < 0 for code in result.exit_codes)


def test_a_runs_truth_replays_to_its_own_gpu_times(simulate) -> None:
    from comminsight.simulator.model import replayed_launches

    result = simulate(
        layout="megatron", ranks=8, tp=2, pp=2, layers=1, micro_batches=2, steps=3, faults=(SlowLink((1, 5), 50.0),)
    )
    truth = result.ground_truth
    ops = pl.DataFrame(truth["operations"])
    # A launch is never enqueued before it was due on the modelled clock; what the machine added is recorded.
    assert (ops["host_delay_ns"] >= 0).all()
    assert (ops["host_delay_ns"] == ops["enqueue_end_ns"] - ops["due_ns"]).all()
    launches = ops.group_by("rank", "step", "launch").agg(
        pl.col("host_delay_ns").first(), pl.col("gpu_start_ns").min(), pl.col("gpu_end_ns").max()
    )
    per_step = launches.filter(pl.col("step") >= 0).group_by("rank", "step").agg(pl.col("host_delay_ns").sum())
    steps = pl.DataFrame(truth["steps"])
    assert (
        steps.join(per_step, on=["rank", "step"])
        .filter(pl.col("host_delay_ns") != pl.col("host_delay_ns_right"))
        .is_empty()
    )
    assert (steps["loop_cpu_ns"] > 0).all()
    # The modelled clock, fed each launch's recorded delay from each rank's origin, gives every launch's GPU
    # start and end as run: the truth holds everything the machine did to the job's timing.
    origin = min(r["origin_ns"] for r in truth["ranks"])
    replayed = replayed_launches(truth)
    launches = launches.sort("rank", "step", "launch")
    for rank in range(8):
        mine = launches.filter(pl.col("rank") == rank)
        modelled = np.array(replayed[rank])  # ms after the origin
        for column, at in (("gpu_start_ns", 0), ("gpu_end_ns", 1)):
            run = (mine[column].to_numpy() - origin) / 1e6
            assert np.abs(run - modelled[:, at]).max() < 1e-3  # ns as run, float ms as modelled
