"""Straggler attribution on recorded raw logs of a simulated DDP job (tests/data/simulated_ddp_rank2_slow).

A run of the simulator kept as it was recorded, so the answer cannot depend on how a run happens to
jitter: on this one the analysis once estimated x1.03 for a job whose own records say x1.58, and the
estimate changed with how many steps were analysed.

**Injected slowdown**: the recording predates the host delays of ground-truth schema 2, so its truth
cannot be replayed as run (``comminsight.simulator.model.fault_slowdown``). Per step s, observed
O_s = latest step end minus earliest step start over the ranks (the ``steps`` table); the injected
extra E_s = the straggler's compute in step s as run minus the same phases without the fault
(``compute_durations`` of the recorded configuration, with and without the fault: same seed, same
jitter draws). Injected slowdown = sum O_s / sum (O_s - E_s). It assumes the straggler's compute lies
on the critical path, which holds in DDP (every collective waits for it).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from comminsight.analysis.stragglers import analyse_stragglers
from comminsight.importers import load

RECORDED = Path(__file__).resolve().parents[1] / "data" / "simulated_ddp_rank2_slow"


def injected_slowdown(truth: dict) -> float:
    """sum O_s / sum (O_s - E_s) over the run's steps (module docstring), from the ground truth alone."""
    from comminsight.simulator.plan import Straggler, build_plan, compute_durations, config_from_dict

    config = config_from_dict(truth["config"])
    clean = dataclasses.replace(config, faults=())
    plan = build_plan(config, check=False)
    extra = np.zeros(config.steps)
    for fault in config.faults:
        if isinstance(fault, Straggler):
            actions = plan.schedules[fault.rank].steps
            slow = compute_durations(config, fault.rank, actions)
            plain = compute_durations(clean, fault.rank, actions)
            extra += [(sum(a) - sum(b)) * 1e6 for a, b in zip(slow, plain, strict=True)]
    steps = (
        pl.DataFrame(truth["steps"]).group_by("step").agg(observed=pl.col("end_ns").max() - pl.col("start_ns").min())
    )
    observed = steps.get_column("observed").to_numpy().astype(np.float64)
    without = observed - extra[steps.get_column("step").to_numpy()]
    return float(observed.sum() / without.sum())


@pytest.fixture(scope="module")
def recorded() -> tuple[pl.DataFrame, dict]:
    table = pl.from_arrow(load(RECORDED / "inspector_logs"))
    assert isinstance(table, pl.DataFrame)
    return table, json.loads((RECORDED / "ground_truth.json").read_text())


def _slow_rank(truth: dict) -> int:
    (fault,) = truth["config"]["faults"]
    return int(fault["rank"])


def test_the_slow_rank_of_a_recorded_ddp_run_is_named_alone_with_its_injected_slowdown(recorded) -> None:
    table, truth = recorded
    report = analyse_stragglers(table)
    injected = injected_slowdown(truth)
    estimated = report.slowdown["without_culprits_ratio"]
    assert report.culprits == [_slow_rank(truth)]
    assert abs(estimated / injected - 1.0) <= 0.10, f"estimated {estimated:.3f}, injected {injected:.3f}"


@pytest.mark.parametrize("steps", [3, 5, 7, 10])
def test_the_estimate_does_not_depend_on_how_many_steps_of_the_job_are_analysed(recorded, steps: int) -> None:
    table, truth = recorded
    # The job's first `steps` steps (and its set-up), cut where the next step's first operation was issued.
    starts = pl.DataFrame(truth["steps"]).group_by("step").agg(pl.col("start_ns").min()).sort("step")
    cut = starts.filter(pl.col("step") == steps).get_column("start_ns")
    part = table.filter(pl.col("enqueue_ns") < cut[0]) if cut.len() else table
    kept = pl.DataFrame(truth["steps"]).filter(pl.col("step") < steps)
    injected = injected_slowdown({**truth, "steps": kept.to_dict(as_series=False)})
    report = analyse_stragglers(part)
    estimated = report.slowdown["without_culprits_ratio"]
    assert report.culprits == [_slow_rank(truth)]
    assert report.slowdown["steps"] == steps
    assert abs(estimated / injected - 1.0) <= 0.10, f"{steps} steps: estimated {estimated:.3f}, injected {injected:.3f}"


def test_less_than_a_step_of_the_job_says_the_evidence_cannot_answer(recorded) -> None:
    table, truth = recorded
    first = pl.DataFrame(truth["steps"]).filter(pl.col("step") == 1).get_column("start_ns").min()
    report = analyse_stragglers(table.filter(pl.col("enqueue_ns") < first))  # the set-up and part of step 0
    assert report.evidence.startswith("insufficient: no training step")
    assert report.culprits == []


DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.mark.parametrize(
    "recording",
    [
        # pp=0 was named saving 84.2 ms a step where the machine cost 26.7 ms through it: stage 0's hosts wait
        # for stage 1's backward at a pipeline receive, and three instances of 32 where a lagging host found
        # the receive complete made that wait read as stage 0's compute.
        "simulated_megatron_clean_machine_slow",
        # pp=1 was named saving 136.8 ms a step where the machine cost 65.8 ms: stage 1's wait for stage 0's
        # first forward read as its compute, the machine having delayed its hosts after the receive.
        "simulated_megatron_clean_stage1_lagging",
    ],
)
def test_a_recorded_fault_free_megatron_run_names_only_what_the_machine_made_slow(recording: str) -> None:
    from simulated_runs import false_culprits

    table = pl.from_arrow(load(DATA / recording / "inspector_logs"))
    truth = json.loads((DATA / recording / "ground_truth.json").read_text())
    report = analyse_stragglers(table.drop("step"))
    assert report.evidence == "ok"
    assert false_culprits(report, truth) == []
