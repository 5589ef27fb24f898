"""The fault kinds of issue 16 through the simulator: rank processes drive the real profiler plugin,
its raw logs (communication only: no compute rows, no coordinates, no step labels) are imported, and
the straggler analysis must name the faulty rank or group, with its cost, and nobody on a noisy job.

Multi-process (marked ``slow``). Compute phases are real sleeps, so every fault costs tens of ms a
step: far above what a busy 2-core machine adds to a sleep or a wake-up, and the same in every step,
where scheduling noise is not.

Ground truth, from the simulator alone:
- compute faults (a late rank, a slowed stage): per step the faulty ranks' compute as run minus the
  same phases without the fault (``compute_durations`` of the recorded configuration, same seed and
  jitter draws), the largest over the faulty ranks (a stage's ranks run in lockstep); slowdown =
  sum of observed steps / sum of (observed - extra), where an observed step spans the earliest
  start to the latest end over the ranks (``steps`` of ground_truth.json);
- a slow link, whose cost depends on what overlaps it: the same job run again without the fault
  (same seed): median observed step with the fault / without. Medians, because a run on a loaded
  machine has disturbed steps (seen: a clean run's steps of 326-330 ms with two of 391 and 411 ms,
  whose mean put the measured slowdown at x1.02 where the typical steps give x1.15).
"""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from comminsight.analysis.stragglers import analyse_stragglers
from comminsight.importers import load

pytestmark = pytest.mark.slow

PROFILER = Path(__file__).resolve().parents[2] / "native" / "profiler"
# Megatron TP2 x PP2 x DP2: ranks 0-3 are stage 0, ranks 4-7 stage 1 (rank = tp + 2 * (dp + 2 * pp)).
MEGATRON = {"layout": "megatron", "ranks": 8, "tp": 2, "pp": 2, "dp": 2, "layers": 1, "micro_batches": 2, "seed": 5}


@pytest.fixture(scope="module")
def plugin() -> Path:
    pytest.importorskip("comminsight.simulator")
    if not (PROFILER / "Makefile").is_file():
        pytest.skip("the profiler plugin is not in this tree")
    built = PROFILER / "build" / "libnccl-profiler-comminsight.so"
    build = subprocess.run(["make", "-s", "-C", str(PROFILER)], capture_output=True, text=True, check=False)
    if build.returncode != 0 and not built.is_file():
        pytest.skip(f"the profiler plugin does not build here: {build.stderr[-400:]}")
    return built


def _run(config, plugin: Path, home: Path) -> tuple[pl.DataFrame, dict]:  # type: ignore[no-untyped-def]
    from comminsight.simulator import run_simulation

    result = run_simulation(config, plugin, home)
    assert all(r["outcome"] == "completed" for r in result.ground_truth["ranks"])
    table = pl.from_arrow(load(home / "inspector_logs"))
    assert isinstance(table, pl.DataFrame)
    assert table.filter(pl.col("op") == "compute").is_empty()  # the plugin sees communication only
    return table.drop("step"), result.ground_truth


def _observed_steps(truth: dict) -> np.ndarray:
    steps = pl.DataFrame(truth["steps"]).group_by("step").agg(o=pl.col("end_ns").max() - pl.col("start_ns").min())
    return steps.sort("step").get_column("o").to_numpy().astype(np.float64)


def _compute_fault_slowdown(truth: dict) -> float:
    from comminsight.simulator.plan import build_plan, compute_durations, config_from_dict

    config = config_from_dict(truth["config"])
    clean = dataclasses.replace(config, faults=())
    plan = build_plan(config, check=False)
    extra = np.zeros(config.steps)
    for rank in sorted({f.rank for f in config.faults}):
        actions = plan.schedules[rank].steps
        slow = compute_durations(config, rank, actions)
        plain = compute_durations(clean, rank, actions)
        extra = np.maximum(extra, [(sum(a) - sum(b)) * 1e6 for a, b in zip(slow, plain, strict=True)])
    observed = _observed_steps(truth)
    return float(observed.sum() / (observed - extra).sum())


def test_a_rank_late_every_step_is_named_with_its_cost(plugin: Path, tmp_path: Path) -> None:
    from comminsight.simulator import Late, SimulationConfig

    # 30 ms late before backward in 600 ms steps (5%), every step.
    late = Late(rank=1, delay_ms=30.0)
    config = SimulationConfig(layout="ddp", ranks=4, steps=10, step_ms=600.0, jitter=0.02, seed=3, faults=(late,))
    table, truth = _run(config, plugin, tmp_path / "home")
    report = analyse_stragglers(table)
    assert report.evidence == "ok"
    assert report.culprits == [1]
    injected = _compute_fault_slowdown(truth)
    estimated = report.slowdown["without_culprits_ratio"]
    assert abs(estimated / injected - 1) <= 0.10, f"estimated x{estimated:.3f}, injected x{injected:.3f}"
    saves = report.culprit_groups[0]["saves_ms_per_step"]
    assert 0.5 * late.delay_ms <= saves <= 1.5 * late.delay_ms  # its cost is stated, about its delay


def test_a_slow_link_is_named_by_its_pair_with_its_cost(plugin: Path, tmp_path: Path) -> None:
    from comminsight.simulator import SimulationConfig, SlowLink

    # The stage-0/stage-1 pair (1, 5): its activation transfers take ~18 ms instead of ~18 us.
    base = SimulationConfig(**MEGATRON, steps=8, step_ms=200.0, jitter=0.02)
    table, truth = _run(dataclasses.replace(base, faults=(SlowLink((1, 5), 1000.0),)), plugin, tmp_path / "slow")
    _, clean = _run(base, plugin, tmp_path / "clean")
    report = analyse_stragglers(table)
    assert sorted(report.culprits) == [1, 5]
    assert sorted(report.culprit_groups[0]["ranks"]) == [1, 5]
    assert report.culprit_groups[0]["communication_ratio"] > report.culprit_groups[0]["compute_ratio"]
    measured = float(np.median(_observed_steps(truth)) / np.median(_observed_steps(clean)))
    estimated = report.slowdown["without_culprits_ratio"]
    assert abs(estimated / measured - 1) <= 0.10, f"estimated x{estimated:.3f}, measured x{measured:.3f}"


@pytest.mark.xfail(
    reason="the stage's four ranks slow the job alike and none stands out; raw logs carry no pp "
    "coordinate, and with one the attribution still names no group (pp=1 x1.147, pp=0 x1.085). "
    "Attribution work of issue 16, not the simulator's.",
    strict=False,
)
def test_a_pipeline_stage_with_slow_backward_is_named(plugin: Path, tmp_path: Path) -> None:
    from comminsight.simulator import SimulationConfig, Straggler

    stage1 = (4, 5, 6, 7)
    faults = tuple(Straggler(r, slow_pct=40.0, phase="backward") for r in stage1)
    config = SimulationConfig(**MEGATRON, steps=8, step_ms=200.0, jitter=0.02, faults=faults)
    table, truth = _run(config, plugin, tmp_path / "home")
    report = analyse_stragglers(table)
    assert sorted(report.culprits) == list(stage1)
    injected = _compute_fault_slowdown(truth)
    estimated = report.slowdown["without_culprits_ratio"]
    assert abs(estimated / injected - 1) <= 0.10, f"estimated x{estimated:.3f}, injected x{injected:.3f}"


def test_a_noisy_job_without_straggler_names_nobody(plugin: Path, tmp_path: Path) -> None:
    from comminsight.simulator import SimulationConfig

    # Every compute phase drawn within +-15% of its plan, independently per rank and step.
    config = SimulationConfig(layout="ddp", ranks=4, steps=10, step_ms=200.0, jitter=0.15, seed=3)
    table, _ = _run(config, plugin, tmp_path / "home")
    report = analyse_stragglers(table)
    assert report.evidence == "ok"
    assert report.culprits == []
    assert report.culprit_groups == []
