"""End to end through the simulator: rank processes drive the real profiler plugin, its raw logs are
imported, and steps and the straggler are recovered from them.

Multi-process: starts one OS process per simulated rank (marked ``slow``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from comminsight.analysis.stragglers import analyse_stragglers
from comminsight.importers import load
from comminsight.semantic import recover_steps

pytestmark = pytest.mark.slow


def test_simulated_ddp_job_steps_and_straggler_are_recovered_from_the_plugin_logs(plugin: Path, tmp_path: Path) -> None:
    from comminsight.simulator import SimulationConfig, Straggler, run_simulation

    # Compute phases are real sleeps: 200 ms steps make the straggler's 60% (over 100 ms a step) far larger
    # than what a busy 2-core machine adds to any rank's sleeps and wake-ups (tens of ms), and ten steps
    # keep one disturbed step from deciding. Seen under a load of 5-7 on 2 cores: ratio 1.36 +- 0.01.
    config = SimulationConfig(
        layout="ddp", ranks=4, steps=10, step_ms=200.0, faults=(Straggler(rank=2, slow_pct=60.0),)
    )
    run_simulation(config, plugin, tmp_path / "home")
    table = load(tmp_path / "home" / "inspector_logs")
    steps = recover_steps(table)
    assert steps.method == "ddp"
    assert len(steps.steps) == config.steps
    report = analyse_stragglers(table)
    assert report.culprits[0] == 2
    assert report.slowdown["ratio"] > 1.2
