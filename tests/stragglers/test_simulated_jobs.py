"""Straggler attribution checked end to end against the simulator's ground truth, for DDP, FSDP and
Megatron (TP x PP x DP) jobs: rank processes drive the real profiler plugin, its raw logs are
imported, steps are recovered from the communication alone and the straggler is attributed.

Multi-process: every test starts one OS process per simulated rank (marked ``slow``). Sizes are kept
small (4-8 ranks, 6 steps of 40 ms of compute, 160 ms for FSDP) for a 2-core machine.

**Injected slowdown** (from ``ground_truth.json`` and the simulator's modelled clock alone; see
docs/simulator.md, "What the machine did"): the run replayed on the modelled clock with each launch
delayed as the machine delayed it in this run, over the same without the straggler and with the named
ranks' launches delayed only as a typical launch (``comminsight.simulator.model.fault_slowdown``): the
job as run over the job without the named ranks' slowness, which is what the estimate estimates. The
replay gives the run's own GPU times. It replaced sum O_s / sum (O_s - E_s) (observed steps minus the
straggler's extra compute), which assumed that compute lay wholly on the critical path: in the Megatron
job at load 9-18 it read x1.416, x1.393, x1.420, x1.321 where the replay without the straggler alone
reads x1.365, x1.332, x1.363, x1.321 and the analysis estimated x1.376, x1.343, x1.376, x1.413. A run
the machine stalled is run again (``simulated_runs.least_stalled_run``): one at load 17 (longest step
x1.60 its median) named nobody.
"""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
from simulated_runs import least_stalled_run

from comminsight.analysis.stragglers import analyse_stragglers
from comminsight.importers import load
from comminsight.semantic import recover_steps

pytestmark = pytest.mark.slow

FUNC_TO_OP = {
    "AllReduce": "all_reduce",
    "AllGather": "all_gather",
    "ReduceScatter": "reduce_scatter",
    "Broadcast": "broadcast",
    "Reduce": "reduce",
    "Send": "send",
    "Recv": "recv",
}

# (layout options, straggler rank). The Megatron straggler (tp=1, dp=0, pp=1) is on the last stage.
JOBS = {
    "ddp": ({"layout": "ddp", "ranks": 4, "steps": 6, "step_ms": 40.0, "seed": 3}, 2),
    # FSDP splits a step's compute into a phase per layer and direction (forward, backward, both around
    # their all-gathers and reduce-scatters): at 40 ms a step, phases of a few ms are no longer than how
    # late a rank's loop wakes after a deadline on a loaded 2-core machine (median 2 ms, 90th percentile
    # 22 ms, docs/simulator.md "Pacing"), and 2 runs in 11 estimated ~19% low. At 160 ms they are tens of ms.
    "fsdp": ({"layout": "fsdp", "ranks": 4, "steps": 6, "step_ms": 160.0, "layers": 2, "seed": 4}, 1),
    "megatron": (
        {
            "layout": "megatron",
            "ranks": 8,
            "tp": 2,
            "pp": 2,
            "dp": 2,
            "layers": 1,
            "micro_batches": 2,
            "steps": 5,
            "step_ms": 40.0,
            "seed": 5,
        },
        5,
    ),
}
SLOW_PCT = 100.0
FROM_STEP = 1


def injected_slowdown(truth: dict, culprits: list[int]) -> float:
    """The straggler's slowdown in the run that happened (module docstring), from the ground truth alone."""
    from comminsight.simulator.model import fault_slowdown

    return fault_slowdown(truth, culprits)


def recorded_operations(table: pl.DataFrame, truth: dict) -> pl.DataFrame:
    """The imported records joined to the ground-truth operations they record (one to one)."""
    ops = pl.DataFrame(truth["operations"]).filter(pl.col("recorded"))
    ops = ops.select(
        "rank",
        "seq",
        "gpu_start_ns",
        "gpu_end_ns",
        comm_id=pl.col("comm_hash"),
        op=pl.col("func").replace_strict(FUNC_TO_OP),
        truth_step=pl.col("step"),
    )
    keys = ["rank", "comm_id", "op", "seq"]
    joined = table.with_row_index("row").with_columns(pl.col("rank").cast(pl.Int64)).join(ops, on=keys, how="inner")
    assert joined.height == table.height == ops.height, "every record matches exactly one ground-truth operation"
    return joined


def assert_steps_match_ground_truth(table: pl.DataFrame, truth: dict) -> None:
    """Recovered steps against the ground truth: same operations per step, same boundaries.

    The plugin stores the GPU times NCCL hands it (``pTimer``) unchanged and the simulator passes
    the same values it writes into the ground truth, so boundaries built from them match exactly
    (tolerance 0). CPU enqueue times are the plugin's own clock (ticks converted to CLOCK_REALTIME,
    off by its calibration, microseconds), so they are not used for boundaries.
    """
    report = recover_steps(table.drop("step"))
    joined = recorded_operations(table, truth)
    recovered = pl.DataFrame({"row": report.event_rows, "recovered": report.event_steps}).with_columns(
        pl.col("row").cast(pl.UInt32)
    )
    joined = joined.join(recovered, on="row", how="left")
    mismatched = joined.filter(pl.col("recovered") != pl.col("truth_step"))
    assert mismatched.height == 0, f"operations in the wrong step: {mismatched.select('rank', 'op', 'seq').head(5)}"
    assert len(report.steps) == truth["config"]["steps"]

    # Per rank: a step starts at its first operation's GPU start and ends where the next one
    # starts (the last step: at its last operation's GPU end).
    first = (
        joined.filter(pl.col("truth_step") >= 0)
        .group_by("rank", "truth_step")
        .agg(first_start=pl.col("gpu_start_ns").min(), last_end=pl.col("gpu_end_ns").max())
        .sort("rank", "truth_step")
        .with_columns(next_start=pl.col("first_start").shift(-1).over("rank"))
        .with_columns(expected_end=pl.coalesce("next_start", "last_end"))
    )
    rank_steps = report.rank_steps.select(
        pl.col("rank").cast(pl.Int64), truth_step=pl.col("step"), start_ns="start_ns", end_ns="end_ns"
    )
    both = first.join(rank_steps, on=["rank", "truth_step"], how="full", coalesce=True)
    assert both.filter(pl.col("start_ns") != pl.col("first_start")).height == 0
    assert both.filter(pl.col("end_ns") != pl.col("expected_end")).height == 0
    # And each recovered start lies inside the rank's step as the training loop saw it.
    cpu = pl.DataFrame(truth["steps"]).select("rank", truth_step="step", cpu_start="start_ns", cpu_end="end_ns")
    inside = both.join(cpu, on=["rank", "truth_step"])
    assert inside.height == both.height
    outside = (pl.col("start_ns") < pl.col("cpu_start")) | (pl.col("start_ns") > pl.col("cpu_end"))
    assert inside.filter(outside).is_empty()


@pytest.mark.parametrize("layout", list(JOBS))
def test_straggler_in_a_simulated_job_is_blamed_first_with_its_injected_slowdown(
    plugin: Path, tmp_path: Path, layout: str
) -> None:
    from comminsight.simulator import SimulationConfig, Straggler

    options, slow_rank = JOBS[layout]
    config = SimulationConfig(**options, faults=(Straggler(rank=slow_rank, slow_pct=SLOW_PCT, from_step=FROM_STEP),))
    result = least_stalled_run(config, plugin, tmp_path / "home")
    truth = json.loads(result.ground_truth_path.read_text())
    table = pl.from_arrow(load(result.home / "inspector_logs"))
    assert isinstance(table, pl.DataFrame)

    assert_steps_match_ground_truth(table, truth)

    report = analyse_stragglers(table.drop("step"))
    injected = injected_slowdown(truth, report.culprits)
    # The injected slowdown is "as run" over "the same run without the straggler": the what-if
    # without the culprits (``ratio`` compares with the ideal job, jitter removed as well).
    estimated = report.slowdown["without_culprits_ratio"]
    assert report.step_source.startswith("recovered")
    assert report.culprits[0] == slow_rank
    assert report.ranks[0]["rank"] == slow_rank
    assert abs(estimated / injected - 1.0) <= 0.10, f"estimated {estimated:.3f}, injected {injected:.3f}"
