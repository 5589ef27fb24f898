"""Simulated runs for the straggler tests: a run the machine stalled is run again (``least_stalled_run``); a
culprit the run's own truth does not explain is a false one (``false_culprits``)."""

from __future__ import annotations

from pathlib import Path

import polars as pl

# A step this many times the run's median step: the machine stalled the run.
STALLED = 1.5
ATTEMPTS = 3


def stall(truth: dict) -> float:
    """The run's longest step over its median step (first start to last end over all ranks)."""
    steps = pl.DataFrame(truth["steps"]).group_by("step").agg(pl.col("start_ns").min(), pl.col("end_ns").max())
    durations = steps["end_ns"] - steps["start_ns"]
    return float(durations.max() / durations.median())  # type: ignore[operator]


def least_stalled_run(config, plugin: Path, home: Path):  # type: ignore[no-untyped-def]
    """Run the job, again when the machine stalled it, up to ATTEMPTS runs; the least stalled one's result.

    A loaded 2-core machine now and then stalls the ranks for a second or more (8-rank Megatron,
    400 ms of compute, at load 16: steps of 1937, 963 and 1082 ms beside ~750 ms ones). Such a run
    is not the job the modelled clock describes, so it is run again: the tests judge the analysis on
    the fault, not on the machine.
    """
    from comminsight.simulator import run_simulation

    runs = []
    for attempt in range(ATTEMPTS):
        result = run_simulation(config, plugin, home / f"attempt-{attempt}")
        assert all(r["outcome"] == "completed" for r in result.ground_truth["ranks"])
        runs.append((stall(result.ground_truth), result))
        if runs[-1][0] <= STALLED:
            break
    best = min(range(len(runs)), key=lambda i: runs[i][0])
    print(f"analysed run {best + 1} of {len(runs)}: longest step x{runs[best][0]:.2f} its median")  # shown on failure
    return runs[best][1]


def false_culprits(report, truth: dict, injected: frozenset[int] = frozenset()) -> list[tuple]:  # type: ignore[no-untyped-def]
    """Named groups that hold no injected fault and whose cost the machine's delays do not explain.

    (group, its stated saving, what the run's truth says the machine cost through it) in ms per step. A
    group of faulty ranks only is the fault's; every other is held to the truth. In a run without a fault
    the culprits together are held to it too: the estimate's saving must be the machine's.
    """
    from comminsight.simulator.model import host_delay_costs

    named = {g["group"]: g for g in report.culprit_groups if not set(g["ranks"]) <= injected}
    if not named:
        return []
    costs = host_delay_costs(truth, {name: g["ranks"] for name, g in named.items()})
    false = [
        (name, g["saves_ms_per_step"], costs[name])
        for name, g in named.items()
        if costs[name] < 0.5 * g["saves_ms_per_step"]
    ]
    if not injected:
        together = report.slowdown["observed_step_ms"] - report.slowdown["estimated_without_culprits_ms"]
        cost = host_delay_costs(truth, {"all": report.culprits})["all"]
        if cost < 0.5 * together:
            false.append(("all culprits", together, cost))
    return false
