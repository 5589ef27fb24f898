"""Analyses: pure functions over the operations table (comminsight.evidence), shared by agent, CLI and site."""

from typing import Any

__all__ = ["analyze_hang"]


def __getattr__(name: str) -> Any:
    # Imported on first use: an analysis module imported on its own (the straggler analysis, say)
    # does not pay for the hang analysis and its report.
    if name == "analyze_hang":
        from comminsight.analysis.hang import analyze_hang

        return analyze_hang
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
