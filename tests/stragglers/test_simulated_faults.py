"""The fault kinds of issue 16 through the simulator: rank processes drive the real profiler plugin,
its raw logs (communication only: no compute rows, no coordinates, no step labels) are imported, and
the straggler analysis must name the faulty rank or group, with its cost, and nobody on a noisy job.

Multi-process (marked ``slow``). Compute phases are real sleeps, so every fault costs tens of ms a
step: far above what a busy 2-core machine adds to a sleep or a wake-up, and the same in every step,
where scheduling noise is not.

Ground truth, from the simulator alone, on its modelled clock (``comminsight.simulator.model``):
the recorded configuration replayed with the same compute durations and transfer times, with the
fault and without it; slowdown = modelled step with / without. Not a second real run: two runs on a
loaded machine differ by more than a slow link costs (seen: a clean run whose median step was 2%
slower than the slow-link run's, where the model says x1.19).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import polars as pl
import pytest

from comminsight.analysis.stragglers import analyse_stragglers
from comminsight.importers import load

pytestmark = pytest.mark.slow

# Megatron TP2 x PP2 x DP2: ranks 0-3 are stage 0, ranks 4-7 stage 1 (rank = tp + 2 * (dp + 2 * pp)).
MEGATRON = {"layout": "megatron", "ranks": 8, "tp": 2, "pp": 2, "dp": 2, "layers": 1, "micro_batches": 2, "seed": 5}


def _run(config, plugin: Path, home: Path) -> tuple[pl.DataFrame, dict]:  # type: ignore[no-untyped-def]
    from comminsight.simulator import run_simulation

    result = run_simulation(config, plugin, home)
    assert all(r["outcome"] == "completed" for r in result.ground_truth["ranks"])
    table = pl.from_arrow(load(home / "inspector_logs"))
    assert isinstance(table, pl.DataFrame)
    assert table.filter(pl.col("op") == "compute").is_empty()  # the plugin sees communication only
    return table.drop("step"), result.ground_truth


def _modelled_slowdown(truth: dict) -> float:
    from comminsight.simulator.model import modelled_step_ms
    from comminsight.simulator.plan import config_from_dict

    config = config_from_dict(truth["config"])
    return modelled_step_ms(config) / modelled_step_ms(dataclasses.replace(config, faults=()))


def test_a_rank_late_every_step_is_named_with_its_cost(plugin: Path, tmp_path: Path) -> None:
    from comminsight.simulator import Late, SimulationConfig

    # 30 ms late before backward in 600 ms steps (5%), every step.
    late = Late(rank=1, delay_ms=30.0)
    config = SimulationConfig(layout="ddp", ranks=4, steps=10, step_ms=600.0, jitter=0.02, seed=3, faults=(late,))
    table, truth = _run(config, plugin, tmp_path / "home")
    report = analyse_stragglers(table)
    assert report.evidence == "ok"
    assert report.culprits == [1]
    injected = _modelled_slowdown(truth)
    estimated = report.slowdown["without_culprits_ratio"]
    assert abs(estimated / injected - 1) <= 0.10, f"estimated x{estimated:.3f}, injected x{injected:.3f}"
    saves = report.culprit_groups[0]["saves_ms_per_step"]
    assert 0.5 * late.delay_ms <= saves <= 1.5 * late.delay_ms  # its cost is stated, about its delay


def test_a_slow_link_is_named_by_its_pair_with_its_cost(plugin: Path, tmp_path: Path) -> None:
    from comminsight.simulator import SimulationConfig, SlowLink

    # The stage-0/stage-1 pair (1, 5): its activation transfers take ~18 ms instead of ~18 us.
    config = SimulationConfig(**MEGATRON, steps=8, step_ms=200.0, jitter=0.02, faults=(SlowLink((1, 5), 1000.0),))
    table, truth = _run(config, plugin, tmp_path / "home")
    report = analyse_stragglers(table)
    # The raw logs carry no coordinates: the stages, DP replicas and TP indices are read from the
    # send/receive chains and the groups (rank = tp + 2 * (dp + 2 * pp)), and the report says so.
    assert report.coordinates == "inferred"
    assert {k: {v: e["ranks"] for v, e in g.items()} for k, g in report.by_coordinate.items()} == {
        "pp": {"0": [0, 1, 2, 3], "1": [4, 5, 6, 7]},
        "dp": {"0": [0, 1, 4, 5], "1": [2, 3, 6, 7]},
        "tp": {"0": [0, 2, 4, 6], "1": [1, 3, 5, 7]},
    }
    assert sorted(report.culprits) == [1, 5]
    assert sorted(report.culprit_groups[0]["ranks"]) == [1, 5]
    assert report.culprit_groups[0]["communication_ratio"] > report.culprit_groups[0]["compute_ratio"]
    injected = _modelled_slowdown(truth)
    estimated = report.slowdown["without_culprits_ratio"]
    assert abs(estimated / injected - 1) <= 0.10, f"estimated x{estimated:.3f}, injected x{injected:.3f}"


@pytest.mark.parametrize(
    ("link", "factor", "crossing"),
    [
        # Stage 1's TP group (DP replica 0): its 8 all-reduces a step, ~18 us each, take ~3.7 ms.
        ((4, 5), 200.0, {"tp2": ["AllReduce"], "mp0": ["AllReduce"]}),
        # Stage 0's DP group (TP index 0): its parameter all-gather (~0.17 ms) and gradient
        # reduce-scatter (~0.34 ms) a step take ~17 and ~34 ms.
        ((0, 2), 100.0, {"dp0": ["AllGather", "ReduceScatter"]}),
    ],
    ids=["tp", "dp"],
)
def test_a_slow_link_inside_a_collective_is_named_by_its_ranks_with_its_cost(
    plugin: Path, tmp_path: Path, link: tuple[int, int], factor: float, crossing: dict
) -> None:
    from comminsight.simulator import SimulationConfig, SlowLink

    config = SimulationConfig(**MEGATRON, steps=8, step_ms=200.0, jitter=0.02, faults=(SlowLink(link, factor),))
    table, truth = _run(config, plugin, tmp_path / "home")
    # The simulator says which collectives cross the link: only the ring of the pair's own group
    # (and, for the TP pair, the model-parallel group whose ring has them as neighbours).
    assert {c["comm_name"]: c["funcs"] for c in truth["faults"][0]["crossed_by"]} == crossing
    report = analyse_stragglers(table)
    assert report.evidence == "ok"
    assert sorted(report.culprits) == sorted(link)
    assert sorted(report.culprit_groups[0]["ranks"]) == sorted(link)
    assert report.culprit_groups[0]["communication_ratio"] > report.culprit_groups[0]["compute_ratio"]
    injected = _modelled_slowdown(truth)
    estimated = report.slowdown["without_culprits_ratio"]
    assert abs(estimated / injected - 1) <= 0.10, f"estimated x{estimated:.3f}, injected x{injected:.3f}"


def test_the_same_megatron_job_without_a_fault_names_nobody(plugin: Path, tmp_path: Path) -> None:
    from comminsight.simulator import SimulationConfig

    config = SimulationConfig(**MEGATRON, steps=8, step_ms=200.0, jitter=0.02)
    table, _ = _run(config, plugin, tmp_path / "home")
    report = analyse_stragglers(table)
    assert report.evidence == "ok"
    assert report.culprits == []
    assert report.culprit_groups == []


@pytest.mark.xfail(
    reason="the stage groups are there (coordinates inferred from the send/receive chains: pp=1 = ranks "
    "4-7, removing its slowness saves ~44 ms a step, x1.13 against the modelled x1.17), but pp=1 is not "
    "named: with two stages its bar is 3x the other stage's saving (~19 ms), and its own excess over "
    "the other stage's operations is negative (gaps are compared across stages that run different "
    "programs). Attribution work of issue 16.",
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
    injected = _modelled_slowdown(truth)
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
