"""The fault kinds of issue 16 through the simulator: rank processes drive the real profiler plugin,
its raw logs (communication only: no compute rows, no coordinates, no step labels) are imported, and
the straggler analysis must name the faulty rank or group, with its cost, and nobody on a noisy job.

Multi-process (marked ``slow``). Compute phases are real sleeps, so every fault costs tens of ms a
step: far above what a busy 2-core machine adds to a sleep or a wake-up, and the same in every step,
where scheduling noise is not.

Ground truth, from the simulator alone, on its modelled clock (``comminsight.simulator.model``):
the recorded configuration replayed with the same compute durations and transfer times, and with
each launch delayed as the machine delayed it in this run (the run's own truth), with the fault and
without it; slowdown = modelled step with / without. Not a second real run: two runs on a loaded
machine differ by more than a slow link costs (seen: a clean run whose median step was 2% slower
than the slow-link run's, where the model says x1.19).

The simulated ranks are processes sharing the machine's cores, so the machine itself can make a
rank or a stage slower in every step, and the trace really shows it. The run's truth says by how
much (``host_delay_costs``: its recorded host delays replayed on the modelled clock). A group named
beside the injected fault, or in a run without one, is a false culprit unless the machine's delays
through it explain at least half of its stated cost (the share the late-rank test asks of a stated cost).
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
from simulated_runs import false_culprits, least_stalled_run

from comminsight.analysis.stragglers import analyse_stragglers
from comminsight.importers import load

pytestmark = pytest.mark.slow

# Megatron TP2 x PP2 x DP2: ranks 0-3 are stage 0, ranks 4-7 stage 1 (rank = tp + 2 * (dp + 2 * pp)).
MEGATRON = {"layout": "megatron", "ranks": 8, "tp": 2, "pp": 2, "dp": 2, "layers": 1, "micro_batches": 2, "seed": 5}


def _run(config, plugin: Path, home: Path) -> tuple[pl.DataFrame, dict]:  # type: ignore[no-untyped-def]
    """Run the job (again if the machine stalled it: ``least_stalled_run``) and import the plugin's raw logs."""
    result = least_stalled_run(config, plugin, home)
    table = pl.from_arrow(load(result.home / "inspector_logs"))
    assert isinstance(table, pl.DataFrame)
    assert table.filter(pl.col("op") == "compute").is_empty()  # the plugin sees communication only
    return table.drop("step"), result.ground_truth


def _modelled_slowdown(truth: dict, report) -> float:  # type: ignore[no-untyped-def]
    """The fault's slowdown in this run, as the analysis estimates it: the run's modelled clock (its host
    delays kept) over the same without the fault and without the machine's share on the named ranks."""
    from comminsight.simulator.model import fault_slowdown

    return fault_slowdown(truth, report.culprits)


def test_a_rank_late_every_step_is_named_with_its_cost(plugin: Path, tmp_path: Path) -> None:
    from comminsight.simulator import Late, SimulationConfig

    # 30 ms late before backward in 600 ms steps (5%), every step.
    late = Late(rank=1, delay_ms=30.0)
    config = SimulationConfig(layout="ddp", ranks=4, steps=10, step_ms=600.0, jitter=0.02, seed=3, faults=(late,))
    table, truth = _run(config, plugin, tmp_path / "home")
    report = analyse_stragglers(table)
    assert report.evidence == "ok"
    assert report.culprits == [1]
    injected = _modelled_slowdown(truth, report)
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
    injected = _modelled_slowdown(truth, report)
    estimated = report.slowdown["without_culprits_ratio"]
    assert abs(estimated / injected - 1) <= 0.10, f"estimated x{estimated:.3f}, injected x{injected:.3f}"


SLOW_LINKS = {
    # Stage 1's TP group (DP replica 0): its 8 all-reduces a step, ~18 us each, take ~7.4 ms.
    "tp": ((4, 5), 400.0, {"tp2": ["AllReduce"], "mp0": ["AllReduce"]}),
    # Stage 0's DP group (TP index 0): its parameter all-gather (~0.17 ms) and gradient
    # reduce-scatter (~0.34 ms) a step take ~34 and ~67 ms.
    "dp": ((0, 2), 200.0, {"dp0": ["AllGather", "ReduceScatter"]}),
}


@pytest.fixture(scope="module", params=list(SLOW_LINKS))
def slow_link_job(request, plugin: Path, tmp_path_factory):  # type: ignore[no-untyped-def]
    """A slow link inside a TP or DP collective: (link, report, ground truth), one job each (see _run)."""
    from comminsight.simulator import SimulationConfig, SlowLink

    link, factor, crossing = SLOW_LINKS[request.param]
    # 400 ms of compute a step: the links cost ~60 and ~100 ms a step (x1.10, x1.17 modelled), well
    # above the per-operation overhead a loaded machine adds to every step (tens of ms), which
    # dilutes the observed ratio and, charged to the link's stage, competes with the link.
    config = SimulationConfig(**MEGATRON, steps=8, step_ms=400.0, jitter=0.02, faults=(SlowLink(link, factor),))
    table, truth = _run(config, plugin, tmp_path_factory.mktemp(f"{request.param}_link") / "home")
    # The simulator says which collectives cross the link: only the ring of the pair's own group
    # (and, for the TP pair, the model-parallel group whose ring has them as neighbours).
    assert {c["comm_name"]: c["funcs"] for c in truth["faults"][0]["crossed_by"]} == crossing
    return link, analyse_stragglers(table), truth


def test_a_slow_link_inside_a_collective_is_named_first_by_its_pair_with_its_cost(slow_link_job) -> None:
    link, report, truth = slow_link_job
    assert report.evidence == "ok"
    assert report.culprit_groups, "nobody named"
    assert sorted(report.culprit_groups[0]["ranks"]) == sorted(link)
    assert report.culprit_groups[0]["communication_ratio"] > report.culprit_groups[0]["compute_ratio"]
    injected = _modelled_slowdown(truth, report)
    estimated = report.slowdown["without_culprits_ratio"]
    assert abs(estimated / injected - 1) <= 0.10, f"estimated x{estimated:.3f}, injected x{injected:.3f}"


def test_nobody_beside_a_slow_links_pair_is_named(slow_link_job) -> None:
    # Was a non-strict xfail for the DP link: 1 run of 10 at load 19.5 named rank 1 second beside the
    # pair, and of 12 recorded runs (load 16-19.5) the decision before the paired bar of two-sibling
    # groups named tp=0 (ranks 0, 2, 4, 6) instead of the pair in one. Now 10 of 10 runs of this module
    # (load 10-13.5) and the 12 recorded runs name the pair alone.
    # Beside the pair, only what the machine made slow in this run may be named (the run's truth).
    link, report, truth = slow_link_job
    assert set(link) <= set(report.culprits)
    assert false_culprits(report, truth, injected=frozenset(link)) == []


def test_the_same_megatron_job_without_a_fault_names_only_what_the_machine_made_slow(
    plugin: Path, tmp_path: Path
) -> None:
    from comminsight.simulator import SimulationConfig

    config = SimulationConfig(**MEGATRON, steps=8, step_ms=400.0, jitter=0.02)
    table, truth = _run(config, plugin, tmp_path / "home")
    report = analyse_stragglers(table)
    assert report.evidence == "ok"
    # No fault is injected: a rank or stage may be named only when the machine really made it slow in
    # this run, by at least half the cost stated for it (2 of 11 runs on an idle 2-core machine once named
    # pp=1 at 7.9 ms of a 598 ms step; whether such a culprit was real is the run's truth to say).
    assert false_culprits(report, truth) == [], [(g["group"], g["saves_ms_per_step"]) for g in report.culprit_groups]


def test_a_pipeline_stage_with_slow_backward_is_named(plugin: Path, tmp_path: Path) -> None:
    from comminsight.simulator import SimulationConfig, Straggler

    stage1 = (4, 5, 6, 7)
    faults = tuple(Straggler(r, slow_pct=40.0, phase="backward") for r in stage1)
    config = SimulationConfig(**MEGATRON, steps=8, step_ms=200.0, jitter=0.02, faults=faults)
    table, truth = _run(config, plugin, tmp_path / "home")
    report = analyse_stragglers(table)
    # Named as the stage (inferred from the send/receive chains), and as compute: without compute rows
    # the gaps between communication are the compute, compared within the stage's own program.
    assert sorted(report.culprits) == list(stage1)
    assert [g["group"] for g in report.culprit_groups] == ["pp=1"]
    assert report.culprit_groups[0]["compute_ratio"] > report.culprit_groups[0]["communication_ratio"]
    injected = _modelled_slowdown(truth, report)
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
