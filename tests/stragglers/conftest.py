"""Fixtures for the straggler tests; the synthetic job generator lives in tests/semantic/synthetic.py."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "semantic"))

from conftest_public import bytedance_dir  # noqa: F401
