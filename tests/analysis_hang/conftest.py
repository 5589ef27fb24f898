"""Fixtures for the hang analysis tests: public Flight Recorder dumps copied into a temp dir."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

PUBLIC = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "public"
FR_PUBLIC = PUBLIC / "flight_recorder_nvrx"


@pytest.fixture
def gpu_error_1st(tmp_path: Path) -> Path:
    """A copy of flight_recorder_nvrx/gpu_error_1st (dumps + fault log), read-only source untouched."""
    if not (FR_PUBLIC / "gpu_error_1st").is_dir():
        pytest.skip("public data not available")
    target = tmp_path / "gpu_error_1st"
    shutil.copytree(FR_PUBLIC / "gpu_error_1st", target)
    for path in target.iterdir():
        path.chmod(0o644)
    return target
