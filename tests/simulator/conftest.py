"""Fixtures of the simulator suite: the real profiler plugin (built once per session) and raw-log reading.

Tests that start rank processes are marked ``slow`` (multi-process); the rest run in-process.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from comminsight.simulator.plan import SimulationConfig
from comminsight.simulator.runner import SimulationResult, run_simulation

REPO = Path(__file__).resolve().parents[2]
PROFILER = REPO / "native/profiler"


@pytest.fixture(scope="session")
def plugin_so() -> Path:
    """The real plugin, built with its own Makefile."""
    if not (PROFILER / "Makefile").is_file():
        pytest.skip("native/profiler/Makefile does not exist yet: the plugin is not written")
    build = subprocess.run(["make", "-s", "-C", str(PROFILER)], capture_output=True, text=True, check=False)
    assert build.returncode == 0, f"building the plugin failed:\n{build.stdout}\n{build.stderr}"
    library = PROFILER / "build/libnccl-profiler-comminsight.so"
    assert library.is_file()
    return library


@pytest.fixture
def simulate(plugin_so: Path, tmp_path: Path):
    """Run a small simulation into a fresh home; returns the SimulationResult."""

    def run(**options) -> SimulationResult:
        options.setdefault("steps", 3)
        options.setdefault("step_ms", 20.0)
        config = SimulationConfig(**options)
        return run_simulation(config, plugin_so, tmp_path / "home")

    return run
