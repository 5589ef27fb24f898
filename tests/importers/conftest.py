"""Fixtures for importer tests: public evidence copied into temp dirs (the source stays read-only)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

PUBLIC = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "public"


def _copy(source: Path, target: Path) -> Path:
    if not source.exists():
        pytest.skip(f"public data {source} not available")
    if source.is_dir():
        shutil.copytree(source, target)
        for path in target.iterdir():
            path.chmod(0o644)
    else:
        shutil.copyfile(source, target)
        target.chmod(0o644)
    return target


@pytest.fixture
def fr_public(tmp_path: Path) -> Path:
    """flight_recorder_nvrx/gpu_error_1st: 16 per-rank pickled dumps and a fault log."""
    return _copy(PUBLIC / "flight_recorder_nvrx" / "gpu_error_1st", tmp_path / "gpu_error_1st")


@pytest.fixture
def kineto_public(tmp_path: Path) -> Path:
    """hta_kineto/nccl_data.json.gz: rank 0 of a 2-rank job."""
    return _copy(PUBLIC / "hta_kineto" / "nccl_data.json.gz", tmp_path / "nccl_data.json.gz")
