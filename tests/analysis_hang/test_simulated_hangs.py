"""Hang and crash analysis checked end to end against the simulator's ground truth.

Each test runs ``comminsight.simulator`` (one OS process per rank driving the real profiler
plugin), injects a hang (a rank stops before one launch) or a crash (a rank exits there without
finalizing or flushing), imports the plugin's raw logs and checks ``analyze_hang`` against
``ground_truth.json``: the injected rank is the only root cause, and the operation it never
issued (``faults[].blocked_ops``: communicator hash, function, sequence, waiting ranks) is a
stuck group in which it is the one missing rank.

Multi-process and a few seconds each (a stalled run ends after the simulator's 2 s stall
timeout), so marked ``slow``; sizes are small (4-8 ranks, 3 steps of 20 ms) for a 2-core machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from comminsight.analysis.hang import analyze_hang
from comminsight.analysis.hang_report import render_text
from comminsight.importers import load

pytestmark = pytest.mark.slow

FUNC_TO_OP = {
    "AllReduce": "all_reduce",
    "AllGather": "all_gather",
    "ReduceScatter": "reduce_scatter",
    "Broadcast": "broadcast",
    "Reduce": "reduce",
}
SMALL = {"steps": 3, "step_ms": 20.0}
MEGATRON = {"layout": "megatron", "ranks": 8, "tp": 2, "pp": 2, "dp": 2, "layers": 1, "micro_batches": 2, **SMALL}


def simulate(plugin: Path, home: Path, options: dict[str, Any], fault: Any) -> tuple[dict, dict]:
    """Run one simulated job with ``fault``; (its ground truth, analyze_hang's report on its raw logs)."""
    from comminsight.simulator import SimulationConfig, run_simulation

    result = run_simulation(SimulationConfig(**options, faults=(fault,)), plugin, home)
    return result.ground_truth, analyze_hang(load(home / "inspector_logs"))


def assert_collective_is_stuck_on(report: dict, blocked: dict, rank: int, *, first: bool) -> None:
    """The blocked collective of the ground truth is a stuck group missing exactly ``rank``."""
    groups = report["stuck_groups"][:1] if first else report["stuck_groups"]
    matching = [
        g
        for g in groups
        if (g["group_id"], g["op"], g["seq"]) == (blocked["comm_hash"], FUNC_TO_OP[blocked["func"]], blocked["seq"])
    ]
    assert matching, f"{blocked} not among {[(g['group_id'], g['op'], g['seq']) for g in groups]}"
    group = matching[0]
    assert group["missing_ranks"] == [rank]
    assert group["entered_ranks"] == sorted(blocked["waiting_ranks"])
    assert group["waiting_ranks"] == sorted(blocked["waiting_ranks"])


def assert_p2p_is_stuck_on(report: dict, blocked: dict, rank: int, peer: int) -> None:
    """The blocked send/recv of the ground truth is a stuck P2P pair waiting for ``rank``."""
    src, dst = (rank, peer) if blocked["func"] == "Send" else (peer, rank)
    matching = [
        g
        for g in report["stuck_groups"]
        if g["seq_kind"] == "p2p" and (g["group_id"], g["src"], g["dst"]) == (blocked["comm_hash"], src, dst)
    ]
    assert len(matching) == 1
    assert matching[0]["seq"] == blocked["seq"]
    assert matching[0]["missing_ranks"] == [rank]
    assert matching[0]["waiting_ranks"] == blocked["waiting_ranks"]


# (layout options, hung rank, step, launch index within the step), seeded.
HANGS = {
    "ddp_rank1_bucket_all_reduce": ({"layout": "ddp", "ranks": 4, "seed": 1, **SMALL}, 1, 1, 2),
    "ddp_rank3_late_in_step2": ({"layout": "ddp", "ranks": 4, "seed": 2, **SMALL}, 3, 2, 4),
    "fsdp_rank2_layer_all_gather": ({"layout": "fsdp", "ranks": 4, "layers": 2, "seed": 3, **SMALL}, 2, 1, 1),
    "megatron_rank2_tp_all_reduce": ({**MEGATRON, "seed": 6}, 2, 1, 5),
}


@pytest.mark.parametrize("case", list(HANGS))
def test_a_hung_rank_is_the_only_root_cause_and_its_blocked_collective_the_first_stuck_group(
    plugin: Path, tmp_path: Path, case: str
) -> None:
    from comminsight.simulator import Hang

    options, rank, step, op_index = HANGS[case]
    truth, report = simulate(plugin, tmp_path / "home", options, Hang(rank=rank, step=step, op_index=op_index))
    (blocked,) = truth["faults"][0]["blocked_ops"]

    assert report["verdict"] == "hang"
    assert report["root_cause_ranks"] == [rank]
    assert_collective_is_stuck_on(report, blocked, rank, first=True)
    assert report["evidence"][str(rank)]["status"] == "root_cause"


@pytest.fixture(scope="module")
def readme_hang(plugin: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    """The README example exactly (simulator defaults otherwise): rank 5 hangs before launch 0 of step 1."""
    from comminsight.simulator import Hang

    home = tmp_path_factory.mktemp("readme") / "home"
    return simulate(
        plugin, home, {"layout": "megatron", "ranks": 8, "tp": 2, "pp": 2}, Hang(rank=5, step=1, op_index=0)
    )


def test_readme_hang_blames_rank_5_alone_and_its_dp_all_gather(readme_hang: tuple[dict, dict]) -> None:
    truth, report = readme_hang
    (blocked,) = truth["faults"][0]["blocked_ops"]
    assert report["verdict"] == "hang"
    assert report["root_cause_ranks"] == [5]
    assert_collective_is_stuck_on(report, blocked, 5, first=True)


def test_readme_hang_rank_inside_a_send_to_a_blocked_peer_waits_on_it(readme_hang: tuple[dict, dict]) -> None:
    # Rank 3 sends to rank 7 (both posted); rank 7's stream is still in the DP all_gather that
    # waits for rank 5. Rank 3 is also missing from a TP all_reduce rank 2 entered, because it
    # is blocked in that send: a waiter, not a root cause. The chain reads 3 -> 7 -> 5.
    _, report = readme_hang
    assert [3, 7, 5] in report["wait_paths"]
    via = {link["rank"]: link["waits_on"] for link in report["chain"]}
    assert via[3] == 7
    assert via[7] == 5
    assert via[5] is None
    rank3 = report["evidence"]["3"]
    assert rank3["status"] == "missing"
    assert rank3["waits_on"] == [7]
    assert rank3["first_pending"]["op"] == "send"
    assert rank3["first_pending"]["peer"] == 7
    pair = [g for g in report["stuck_groups"] if g["seq_kind"] == "p2p" and {g["src"], g["dst"]} == {3, 7}]
    assert len(pair) == 1
    assert pair[0]["blocked_earlier_ranks"] == [7]
    assert pair[0]["waiting_ranks"] == [3]


def test_readme_hang_text_report_reads_verdict_then_evidence_then_chain(readme_hang: tuple[dict, dict]) -> None:
    _, report = readme_hang
    console = Console(record=True, width=200)
    render_text(report, console)
    text = console.export_text()
    lines = text.splitlines()
    assert lines[0] == "Verdict: hang"
    assert lines[1].startswith("Hang: progress stopped first at rank(s) 5;")
    assert "dp3 all_gather seq 1" in lines[1]
    assert "Look first at rank(s): 5" in lines[2]
    stuck, chain = text.index("Stuck groups"), text.index("Dependency chain")
    assert stuck < text.index("Root-cause ranks") < chain
    assert "3 -> 7 -> 5" in text[chain:]
    assert "rank 3 (waits on 7)" in text[chain:]


CRASHES = {
    "ddp_rank2": ({"layout": "ddp", "ranks": 4, "seed": 8, **SMALL}, 2, 1, 3),
    # Launch 6 of step 1 on rank 4 (first pipeline stage 1, dp 0) is a send/recv pair with rank 0.
    "megatron_rank4_pipeline_send_recv": ({**MEGATRON, "seed": 9}, 4, 1, 6),
}


@pytest.mark.parametrize("case", list(CRASHES))
def test_a_crashed_rank_is_named_first_and_stopped_reporting(plugin: Path, tmp_path: Path, case: str) -> None:
    from comminsight.simulator import Crash

    options, rank, step, op_index = CRASHES[case]
    truth, report = simulate(plugin, tmp_path / "home", options, Crash(rank=rank, step=step, op_index=op_index))
    assert next(r for r in truth["ranks"] if r["rank"] == rank)["outcome"] == "crashed"

    assert report["verdict"] == "hang"
    assert report["root_cause_ranks"] == [rank]
    assert rank in report["failures"]["stopped_reporting_ranks"]
    assert str(rank) not in report["failures"]["abandoned_ops"]  # it never reached finalize
    assert report["stuck_groups"][0]["missing_ranks"] == [rank]
    members = {c["comm_hash"]: c["ranks"] for c in truth["communicators"]}
    for blocked in truth["faults"][0]["blocked_ops"]:
        if blocked["func"] in ("Send", "Recv"):
            peer = members[blocked["comm_hash"]][blocked["peer"]]  # the truth gives the peer's comm rank
            assert_p2p_is_stuck_on(report, blocked, rank, peer)
        else:
            assert_collective_is_stuck_on(report, blocked, rank, first=False)
