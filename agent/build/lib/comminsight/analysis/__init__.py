"""Analyses: pure functions over the operations table (comminsight.evidence), shared by agent, CLI and site."""

from comminsight.analysis.hang import analyze_hang

__all__ = ["analyze_hang"]
