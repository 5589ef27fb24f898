"""Fixtures for the semantic-engine tests: the public ByteDance per-op trace copied into a temp dir."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

PUBLIC = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "public" / "bytedance_straggler"


@pytest.fixture
def bytedance_dir(tmp_path: Path) -> Path:
    """A writable copy of bytedance_straggler (trace-ST.parquet, result-ST.json, meta-ST.yaml)."""
    if not (PUBLIC / "trace-ST.parquet").is_file():
        pytest.skip("public data not available")
    target = tmp_path / "bytedance_straggler"
    target.mkdir()
    for name in ("trace-ST.parquet", "result-ST.json", "meta-ST.yaml"):
        shutil.copy(PUBLIC / name, target / name)
        (target / name).chmod(0o644)
    return target
