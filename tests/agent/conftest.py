"""Fixtures for the agent tests (defined in agentkit, registered here)."""

from agentkit import home, site, start_agent  # noqa: F401
