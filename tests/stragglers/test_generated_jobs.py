"""Straggler attribution on generated jobs it was not tuned on, against the generator's own truth.

Each job is a ByteDance-format trace (compute rows, communication rows, dp/pp/tp coordinates)
written by ``comminsight.simulator.tracegen`` and read back through the table importer, as a user's
trace would be. The generator knows which ranks it slowed and what the job would have taken with
every operation at its nominal duration (``truth["slowdown"]``) or at its mean over ranks and steps
(``truth["slowdown_vs_mean"]``, the what-if study's ideal). Tolerance: 10%.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import polars as pl
import pytest

from comminsight.analysis.stragglers import analyse_stragglers
from comminsight.importers import load
from comminsight.simulator.tracegen import Fault, GeneratedJob, Layout, generate, write_kineto

TOLERANCE = 0.10
MEGATRON_64 = Layout(tp=4, pp=4, dp=4)
CP_128 = Layout(pp=2, dp=32, cp=2)
SMALL = Layout(tp=2, pp=2, dp=2)
MID = Layout(tp=2, pp=2, dp=4)
PIPELINE_128 = Layout(tp=2, pp=4, dp=16)
DEEP_64 = Layout(pp=8, dp=8, microbatches=8)


def _late_by(layout: Layout, share: float) -> float:
    """A delay of ``share`` of the job's ideal step, in ms."""
    return share * generate(layout, steps=2, noise=0.0).truth["ideal_step_s"] * 1e3


JOBS: dict[str, tuple[Layout, tuple[Fault, ...], dict]] = {
    "64 GPUs TP4xPP4xDP4, DP group 1 computes 2x slower": (
        MEGATRON_64,
        (Fault("compute", {"dp": 1}, factor=2.0),),
        {"group": "dp=1"},
    ),
    "128 GPUs DP32xPP2xCP2, backward of stage 1 1.4x slower": (
        CP_128,
        (Fault("compute", {"pp": 1}, factor=1.4, phase="backward"),),
        {"group": "pp=1"},
    ),
    "16 GPUs, one data-parallel communicator's transfers 4x slower": (
        MID,
        (Fault("comm", {"pp": 1, "tp": 0}, factor=4.0, group="dp"),),
        {"group": "comm=dp:pp1tp0"},
    ),
    "16 GPUs, P2P between the stages of one pipeline 30x slower": (
        MID,
        (Fault("comm", {"dp": 2, "tp": 1}, factor=30.0, group="pp"),),
        {"group": "comm=pp:dp2cp0tp1"},
    ),
    "8 GPUs, rank 1 late by 3% of the step before its TP all-reduce": (
        SMALL,
        (Fault("late", {"rank": 1}, delay_ms=_late_by(SMALL, 0.03), before="tp-all-reduce"),),
        {"group": "rank=1"},
    ),
    # Deeper pipelines: their steps overlap in time (the first stage starts the next step while
    # the last finishes this one), which once read as restarting clocks and shifted every step.
    "64 GPUs TP4xPP4xDP4, backward of the first stage 1.4x slower": (
        MEGATRON_64,
        (Fault("compute", {"pp": 0}, factor=1.4, phase="backward"),),
        {"group": "pp=0"},
    ),
    "64 GPUs TP4xPP4xDP4, one data-parallel communicator's transfers 4x slower": (
        MEGATRON_64,
        (Fault("comm", {"pp": 0, "tp": 0}, factor=4.0, group="dp"),),
        {"group": "comm=dp:pp0tp0"},
    ),
    "64 GPUs TP4xPP4xDP4, rank 1 late by 3% of the step before its TP all-reduce": (
        MEGATRON_64,
        (Fault("late", {"rank": 1}, delay_ms=_late_by(MEGATRON_64, 0.03), before="tp-all-reduce"),),
        {"group": "rank=1"},
    ),
    # In a deep pipeline a slow DP group finishes every step late and the next begins late: the
    # replay must carry each scenario's own step ends into the next step (an observed start
    # carried in kept the lateness in the "healthy" job: -13%).
    "64 GPUs DP8xPP8, DP group 1 computes 2x slower": (
        DEEP_64,
        (Fault("compute", {"dp": 1}, factor=2.0),),
        {"group": "dp=1"},
    ),
    "128 GPUs TP2xPP4xDP16, backward of the last stage 1.4x slower": (
        PIPELINE_128,
        (Fault("compute", {"pp": 3}, factor=1.4, phase="backward"),),
        {"group": "pp=3"},
    ),
    # Its TP coordinate group (64 ranks) sums enough jitter to look as slow as it: the rank that
    # saves most of what the group saves is named, not the group.
    "128 GPUs TP2xPP4xDP16, rank 1 late by 3% of the step before its TP all-reduce": (
        PIPELINE_128,
        (Fault("late", {"rank": 1}, delay_ms=_late_by(PIPELINE_128, 0.03), before="tp-all-reduce"),),
        {"group": "rank=1"},
    ),
    "128 GPUs DP32xPP2xCP2, rank 1 late by 3% of the step before its backward": (
        CP_128,
        (Fault("late", {"rank": 1}, delay_ms=_late_by(CP_128, 0.03), before="backward-compute"),),
        {"group": "rank=1"},
    ),
}


@cache
def _job(name: str, seed: int = 0) -> tuple[GeneratedJob, pl.DataFrame]:
    layout, faults, _ = JOBS[name]
    job = generate(layout, steps=5, faults=faults, seed=seed)
    return job, job.table


def _read_back(job: GeneratedJob, tmp_path: Path) -> pl.DataFrame:
    table = pl.from_arrow(load(job.write(tmp_path / "trace.parquet")))
    assert isinstance(table, pl.DataFrame)
    return table


@pytest.mark.parametrize("name", list(JOBS))
def test_the_generated_culprit_is_named_and_no_healthy_rank_beside_it(name: str, tmp_path: Path) -> None:
    job, _ = _job(name)
    report = analyse_stragglers(_read_back(job, tmp_path))
    assert report.evidence == "ok"
    assert [g["group"] for g in report.culprit_groups] == [JOBS[name][2]["group"]]
    assert sorted(report.culprits) == job.truth["culprits"]


@pytest.mark.parametrize("name", list(JOBS))
def test_the_slowdown_is_estimated_within_ten_percent_of_the_generators_ideal(name: str, tmp_path: Path) -> None:
    job, _ = _job(name)
    sd = analyse_stragglers(_read_back(job, tmp_path)).slowdown
    truth = job.truth
    print(
        f"\n{name}: x{sd['ratio']:.3f} vs x{truth['slowdown_vs_mean']:.3f} (mean ideal); "
        f"x{sd['healthy_ratio']:.3f} vs x{truth['slowdown']:.3f} (healthy ideal)"
    )
    assert sd["replay_error"] < 0.01
    assert abs(sd["ratio"] / truth["slowdown_vs_mean"] - 1.0) <= TOLERANCE
    assert abs(sd["healthy_ratio"] / truth["slowdown"] - 1.0) <= TOLERANCE


HALF_SLOW = {
    "one of two DP groups computes 2x slower": (Fault("compute", {"dp": 1}, factor=2.0), "dp=1"),
    "the second of two stages runs backward 1.4x slower": (
        Fault("compute", {"pp": 1}, factor=1.4, phase="backward"),
        "pp=1",
    ),
    "the first of two stages runs backward 1.4x slower": (
        Fault("compute", {"pp": 0}, factor=1.4, phase="backward"),
        "pp=0",
    ),
}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", list(HALF_SLOW))
def test_a_group_holding_half_the_ranks_is_named_alone_when_it_is_slow(name: str, seed: int, tmp_path: Path) -> None:
    # Half the job slow: a reference taken over every rank sits between the two halves and reads
    # the slowness as noise; the healthy half must be the reference, and nothing named beside it.
    fault, group = HALF_SLOW[name]
    job = generate(SMALL, steps=5, faults=(fault,), seed=seed)
    report = analyse_stragglers(_read_back(job, tmp_path))
    assert [g["group"] for g in report.culprit_groups] == [group]
    assert sorted(report.culprits) == job.truth["culprits"]
    assert abs(report.slowdown["ratio"] / job.truth["slowdown_vs_mean"] - 1.0) <= TOLERANCE


def test_removing_or_restoring_any_subset_never_reads_as_a_speed_up(tmp_path: Path) -> None:
    job, _ = _job("64 GPUs TP4xPP4xDP4, DP group 1 computes 2x slower")
    report = analyse_stragglers(_read_back(job, tmp_path))
    for kind, entries in report.attribution.items():
        for entry in entries:
            assert entry["slowdown_ratio"] >= 1.0 - 1e-9, (kind, entry)
            assert entry.get("gain_without", 1.0) >= 1.0 - 1e-9, (kind, entry)
    for values in report.by_coordinate.values():
        assert all(v["slowdown_ratio"] >= 1.0 - 1e-9 for v in values.values())
    slow_dp = next(e for e in report.attribution["dp"] if e["subset"] == "1")
    assert slow_dp["slowdown_ratio"] == max(e["slowdown_ratio"] for e in report.attribution["dp"])
    # The slow group's compute explains it, not its communication.
    group = report.culprit_groups[0]
    assert group["compute_ratio"] > group["communication_ratio"]


def test_context_parallel_groups_are_attributed_like_the_other_coordinates(tmp_path: Path) -> None:
    job, _ = _job("128 GPUs DP32xPP2xCP2, backward of stage 1 1.4x slower")
    report = analyse_stragglers(_read_back(job, tmp_path))
    assert sorted(e["subset"] for e in report.attribution["cp"]) == ["0", "1"]
    assert set(report.by_coordinate["cp"]) == {"0", "1"}
    # Half of each CP group sits in the slow stage: neither CP group is the cause.
    assert [g["group"] for g in report.culprit_groups] == ["pp=1"]


def test_the_late_ranks_tensor_parallel_partner_is_not_named(tmp_path: Path) -> None:
    job, _ = _job("8 GPUs, rank 1 late by 3% of the step before its TP all-reduce")
    report = analyse_stragglers(_read_back(job, tmp_path))
    assert report.culprits == [1]
    # Its partner waited for it in every all-reduce: an effect, visible as a waiting edge.
    assert any(e["waiter"] == 0 and e["waited_for"] == 1 for e in report.waiting_edges)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_noisy_job_without_a_straggler_names_no_one(seed: int, tmp_path: Path) -> None:
    job = generate(MID, steps=6, noise=0.05, seed=seed)
    report = analyse_stragglers(_read_back(job, tmp_path))
    assert report.culprits == []
    assert report.evidence == "ok"


@pytest.mark.parametrize("layout", [MEGATRON_64, PIPELINE_128], ids=["64 GPUs TP4xPP4xDP4", "128 GPUs TP2xPP4xDP16"])
def test_a_noisy_pipeline_without_a_straggler_names_no_one_and_its_ratio_is_the_noise(
    layout: Layout, tmp_path: Path
) -> None:
    job = generate(layout, steps=5, noise=0.05, seed=0)
    report = analyse_stragglers(_read_back(job, tmp_path))
    assert report.culprits == []
    assert abs(report.slowdown["ratio"] / job.truth["slowdown_vs_mean"] - 1.0) <= TOLERANCE
    assert abs(report.slowdown["healthy_ratio"] / job.truth["slowdown"] - 1.0) <= TOLERANCE


def test_step_times_are_the_jobs_iteration_times_when_pipeline_steps_overlap(tmp_path: Path) -> None:
    # The first stage starts a step while the last still drains the previous one: a step lasts
    # from the previous step's last end to its own, so the steps add up to the job's time.
    job, _ = _job("64 GPUs DP8xPP8, DP group 1 computes 2x slower")
    report = analyse_stragglers(_read_back(job, tmp_path))
    per_step = [s["duration_ms"] for s in report.per_step]
    assert len(per_step) == 5
    assert abs(sum(per_step) / 5 / (job.truth["observed_step_s"] * 1e3) - 1.0) < 0.01
    assert abs(report.slowdown["observed_step_ms"] / (job.truth["observed_step_s"] * 1e3) - 1.0) < 0.01


def test_a_late_rank_whose_delay_a_pipeline_bubble_absorbs_costs_nothing_and_is_not_named(tmp_path: Path) -> None:
    # Rank 1 (first stage) waits 3% of the step before its first backward in DP8xPP8: it would
    # have waited for the backward from the next stage anyway. The generator's own replay of the
    # same job (same noise draws) without the delay is exactly as long: no cost, so no culprit.
    delay = Fault("late", {"rank": 1}, delay_ms=_late_by(DEEP_64, 0.03), before="backward-compute")
    job = generate(DEEP_64, steps=5, faults=(delay,), seed=0)
    without = generate(DEEP_64, steps=5, seed=0)
    cost = job.truth["observed_step_s"] - without.truth["observed_step_s"]
    assert abs(cost) < 1e-4 * without.truth["observed_step_s"]
    report = analyse_stragglers(_read_back(job, tmp_path))
    assert report.culprits == []
    # Rank 1's own share of the step, replayed, is within the job's noise.
    rank1 = next(r for r in report.ranks if r["rank"] == 1)
    assert rank1["straggler_index"] < 0.005


@pytest.mark.parametrize("seed", range(6))
def test_a_slow_link_is_named_alone_whatever_the_seed(seed: int, tmp_path: Path) -> None:
    # A coordinate group holding the link's ranks "costs" the link's time in the job as it ran;
    # that is the link's effect, not the group's own: once the link is named, nothing else is.
    job = generate(SMALL, steps=5, faults=(Fault("comm", {"pp": 0, "tp": 0}, factor=4.0, group="dp"),), seed=seed)
    report = analyse_stragglers(_read_back(job, tmp_path))
    assert [g["group"] for g in report.culprit_groups] == ["comm=dp:pp0tp0"]
    assert abs(report.slowdown["ratio"] / job.truth["slowdown_vs_mean"] - 1.0) <= TOLERANCE


def test_per_step_results_carry_the_jobs_own_step_ids(tmp_path: Path) -> None:
    job, _ = _job("8 GPUs, rank 1 late by 3% of the step before its TP all-reduce")
    report = analyse_stragglers(_read_back(job, tmp_path))
    assert [s["step"] for s in report.per_step] == job.truth["steps"]
    assert report.heatmap["steps"] == job.truth["steps"]
    row = report.heatmap["ranks"].index(1)
    late = report.heatmap["delay_ms"][row]
    others = [d for r, d in zip(report.heatmap["ranks"], report.heatmap["delay_ms"], strict=True) if r != 1]
    assert all(v > max(o[i] for o in others) for i, v in enumerate(late))


def test_evidence_without_timings_says_it_cannot_answer(tmp_path: Path) -> None:
    job, _ = _job("8 GPUs, rank 1 late by 3% of the step before its TP all-reduce")
    table = _read_back(job, tmp_path).with_columns(
        start_ns=pl.lit(None, dtype=pl.Int64), end_ns=pl.lit(None, dtype=pl.Int64)
    )
    report = analyse_stragglers(table)
    assert report.evidence.startswith("insufficient")
    assert "timings" in report.evidence
    assert report.culprits == []


def test_kineto_traces_of_a_rank_sleeping_before_backward_name_that_rank(tmp_path: Path) -> None:
    # 8 ranks, ~1.45 s steps under the profiler, rank 5 sleeps 40 ms on the CPU before backward.
    truth = write_kineto(tmp_path / "traces", ranks=8, steps=8, slow_rank=5, sleep_ms=40.0)
    report = analyse_stragglers(load(tmp_path / "traces"))
    assert report.culprits == truth["culprits"]
    assert report.culprit_groups[0]["saves_ms_per_step"] > 0
    assert abs(report.slowdown["ratio"] / truth["slowdown"] - 1.0) <= TOLERANCE
    assert {e["waited_for"] for e in report.waiting_edges[:7]} == {5}


def test_kineto_traces_without_a_straggler_name_no_one(tmp_path: Path) -> None:
    write_kineto(tmp_path / "traces", ranks=8, steps=8, seed=4)
    report = analyse_stragglers(load(tmp_path / "traces"))
    assert report.culprits == []


TWO_STAGES = {"8 GPUs TP2xPP2xDP2": SMALL, "128 GPUs DP32xPP2xCP2": CP_128}


@pytest.mark.parametrize("keep_coordinates", [True, False], ids=["coordinates", "no-coordinates"])
@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("name", list(TWO_STAGES))
def test_a_slow_stage_is_named_with_its_cost_from_communication_rows_alone(
    name: str, stage: int, keep_coordinates: bool, tmp_path: Path
) -> None:
    # Without compute rows the compute is the gaps between communication, and the two stages run
    # different programs (1F1B: the k-th gap is a forward on one stage, a backward on the other).
    layout = TWO_STAGES[name]
    fault = Fault("compute", {"pp": stage}, factor=1.4, phase="backward")
    job = generate(layout, steps=5, faults=(fault,), seed=1)
    clean = generate(layout, steps=5, seed=1)  # same noise draws, no fault
    comm = job.communication_only()
    if not keep_coordinates:
        comm = comm.drop("cp_rank", "dp_rank", "stage", "tp_rank")
    comm.write_parquet(tmp_path / "comm.parquet")
    report = analyse_stragglers(pl.from_arrow(load(tmp_path / "comm.parquet")))
    assert [g["group"] for g in report.culprit_groups] == [f"pp={stage}"]
    assert sorted(report.culprits) == job.truth["culprits"]
    cost = job.truth["observed_step_s"] / clean.truth["observed_step_s"]
    assert abs(report.slowdown["without_culprits_ratio"] / cost - 1.0) <= TOLERANCE


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_noisy_two_stage_job_without_straggler_names_nobody_from_communication_rows_alone(
    seed: int, tmp_path: Path
) -> None:
    job = generate(CP_128, steps=5, noise=0.05, seed=seed)
    job.communication_only().write_parquet(tmp_path / "comm.parquet")
    report = analyse_stragglers(pl.from_arrow(load(tmp_path / "comm.parquet")))
    assert report.culprits == []


@pytest.mark.parametrize("seed", [0, 2])
def test_a_two_stage_jobs_slow_stage_is_named_against_its_one_sibling_under_heavy_tailed_noise(
    seed: int, tmp_path: Path
) -> None:
    # 16 GPUs TP4xPP2xDP2, stage 0's backward x1.2 (about 7 ms of a 117 ms step), 5% noise and 2% of
    # operations 1 + 0.1 x Pareto(1.5) longer. Stage 0 saves 9.8 and 11.4 ms a step; hiccups made its
    # one sibling, stage 1, save 4.3 and 3.9 ms, and three times that (12.8, 11.6 ms) was the bar:
    # nobody was named. The bar is now the sibling's saving plus the paired difference's noise over
    # steps (7.7, 10.6 ms), and each step's saving is held against the sibling's of that step.
    layout = Layout(tp=4, pp=2, dp=2)
    job = generate(
        layout,
        steps=5,
        faults=(Fault("compute", {"pp": 0}, factor=1.2, phase="backward"),),
        noise=0.05,
        seed=seed,
        tail=0.02,
    )
    report = analyse_stragglers(_read_back(job, tmp_path))
    assert [g["group"] for g in report.culprit_groups] == ["pp=0"]
    assert sorted(report.culprits) == job.truth["culprits"]
    assert abs(report.slowdown["ratio"] / job.truth["slowdown_vs_mean"] - 1.0) <= TOLERANCE
