"""Site test fixtures: every test gets its own data directory (bootstrap token file, uploads, Parquet)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def data_dir(settings, tmp_path: Path) -> Path:
    path = tmp_path / "data"
    path.mkdir()
    settings.DATA_DIR = path
    settings.BOOTSTRAP_TOKEN_PATH = path / "bootstrap-token"
    return path
