"""Fixtures for the semantic-engine tests (the public-data fixture lives in conftest_public.py)."""

from conftest_public import bytedance_dir  # noqa: F401
