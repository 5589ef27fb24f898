"""Hang analysis on simulated jobs (hang_simulation): each case has one right answer.

Every case runs twice: with full timing (what this project's profiler records) and in Flight
Recorder style (no times, pending entries only, completion watermarks), where the analysis must
reason from sequence counts alone. Seeds pick the hung rank and the point where it hangs.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hang_simulation import Layout, fr_style, programs_for, run, swap_op

from comminsight.analysis import analyze_hang
from comminsight.evidence import empty_table

STYLES = {"timed": lambda t: t, "flight_recorder": fr_style}
LAYOUTS = {"dp": Layout(tp=1, pp=1, dp=8), "tp": Layout(tp=4, pp=1, dp=2), "pp": Layout(tp=2, pp=4, dp=2)}


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("layout_name", LAYOUTS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_single_hung_rank_is_named_first(layout_name, style, seed):
    layout = LAYOUTS[layout_name]
    programs = programs_for(layout)
    rng = np.random.default_rng(seed)
    hung = int(rng.integers(layout.world))
    position = int(rng.integers(1, len(programs[hung]) - 1))
    report = analyze_hang(STYLES[style](run(layout, programs, hang_at={hung: position})))
    assert report["verdict"] == "hang"
    assert report["root_cause_ranks"] == [hung]
    assert report["evidence"][str(hung)]["status"] == "root_cause"
    assert any(hung in g["missing_ranks"] for g in report["stuck_groups"])


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("seed", [0, 1])
def test_two_independent_hangs_are_both_root_causes(style, seed):
    layout = Layout(tp=4, pp=1, dp=4)
    programs = programs_for(layout)
    rng = np.random.default_rng(seed)
    # Two different tensor-parallel groups, hanging before the first data-parallel exchange.
    groups = rng.choice(layout.dp, size=2, replace=False)
    hung = sorted(int(g) * layout.tp + int(rng.integers(layout.tp)) for g in groups)
    report = analyze_hang(STYLES[style](run(layout, programs, hang_at={r: int(rng.integers(1, 8)) for r in hung})))
    assert sorted(report["root_cause_ranks"]) == hung


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("change", [{"op": "broadcast"}, {"count": 77}, {"dtype": "float16"}])
def test_a_rank_calling_a_different_collective_is_blamed_for_the_mismatch(style, change):
    layout = Layout(tp=4, pp=1, dp=2)
    programs = programs_for(layout)
    odd, position = 6, 5
    programs[odd] = swap_op(programs[odd], position, **change)
    report = analyze_hang(STYLES[style](run(layout, programs)))
    assert report["verdict"] == "hang"
    assert report["root_cause_ranks"] == [odd]
    first = report["stuck_groups"][0]
    assert first["kind"] == "mismatch"
    assert odd in next(iter(first["mismatch"].values())).get(str(change[next(iter(change))]), [])


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("seed", [3, 4])
def test_a_rank_missing_from_the_evidence_is_the_root_cause(style, seed):
    layout = Layout(tp=2, pp=2, dp=2)
    programs = programs_for(layout)
    rng = np.random.default_rng(seed)
    hung = int(rng.integers(layout.world))
    table = run(layout, programs, hang_at={hung: int(rng.integers(1, 10))})
    table = table.filter(pc.not_equal(table["rank"], hung))  # its process died: no dump, no log
    report = analyze_hang(STYLES[style](table))
    assert report["root_cause_ranks"] == [hung]
    assert report["failures"]["no_evidence_ranks"] == [hung]
    assert report["evidence"][str(hung)]["last_op"] is None


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_pipeline_p2p_deadlock_blames_both_stages(style, stage):
    layout = Layout(tp=1, pp=4, dp=1)
    programs = programs_for(layout)
    a, b = stage, stage + 1
    # Both neighbours send to each other where each should have received first.
    for rank, peer in ((a, b), (b, a)):
        position = next(i for i, op in enumerate(programs[rank]) if op.op == "recv" and op.peer == peer)
        programs[rank] = swap_op(programs[rank], position, op="send")
    report = analyze_hang(STYLES[style](run(layout, programs)))
    assert report["verdict"] == "hang"
    assert sorted(report["root_cause_ranks"]) == [a, b]
    assert any(g["kind"] == "p2p_unmatched" for g in report["stuck_groups"])


@pytest.mark.parametrize("style", STYLES)
def test_a_job_that_finished_has_no_hang(style):
    layout = Layout(tp=2, pp=2, dp=2)
    report = analyze_hang(STYLES[style](run(layout, programs_for(layout))))
    assert report["verdict"] == "no_hang"
    assert report["root_cause_ranks"] == []
    assert report["stuck_groups"] == []


def test_empty_evidence_is_insufficient():
    report = analyze_hang(empty_table())
    assert report["verdict"] == "insufficient_evidence"
    assert report["root_cause_ranks"] == []


def test_a_finished_job_with_a_member_that_left_no_evidence_is_insufficient():
    layout = Layout(tp=2, pp=1, dp=2)
    table = run(layout, programs_for(layout))
    report = analyze_hang(table.filter(pc.not_equal(table["rank"], 3)))
    assert report["verdict"] == "insufficient_evidence"
    assert report["failures"]["no_evidence_ranks"] == [3]


def test_abandoned_operations_and_silent_ranks_are_failure_evidence():
    layout = Layout(tp=2, pp=1, dp=2)
    table = run(layout, programs_for(layout), hang_at={1: 3})
    rows = table.to_pylist()
    for row in rows:
        if row["state"] == "started":
            row["state"] = "abandoned"
        if row["rank"] == 1 and row["end_ns"]:
            row["end_ns"] -= 10**12  # rank 1 went quiet long before the others
            row["enqueue_ns"] -= 10**12
            row["start_ns"] -= 10**12
    report = analyze_hang(pa.Table.from_pylist(rows, schema=table.schema), silence_s=60)
    assert report["failures"]["abandoned_ops"]
    assert report["failures"]["stopped_reporting_ranks"] == [1]
    assert report["root_cause_ranks"][0] == 1
