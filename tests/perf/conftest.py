"""Fixtures for the communication-performance tests; the job generator is tests/semantic/synthetic.py."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "semantic"))
